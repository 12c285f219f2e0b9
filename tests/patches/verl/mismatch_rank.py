"""Rank function for the mismatch test: verl 0.4.1's real MegatronPPOActor.make_minibatch_iterator,
update_policy and forward_backward_batch (its forward_step, logits_processor and loss_func), verl's
gptmodel_forward with packed sequences, its vocab-parallel log-prob and entropy, megatron-core's
schedule and parallel_state, on gloo ranks (data parallel over all of them).

Stand-ins, for what is not under test or cannot run here:
- the model: a two-matrix torch policy with the attributes Megatron's schedule reads (a GPTModel's
  packed-sequence attention needs Transformer Engine or the host layer spec; the logits are what
  the measurement reads, and they are checked against a direct computation);
- the optimizer: plain SGD behind MegatronOptimizer's step() contract (True, grad norm, zeros);
- the CPU platform's own records (cpu.*) for megatron's CUDA calls, as in the tiny run.
"""

from __future__ import annotations

import types

import torch

B, P, R, V, H = 6, 4, 5, 13, 8  # sequences per rank, prompt, response, vocab, hidden
REUSE_IDS = ["verl.old_log_prob.policy_loss", "verl.old_log_prob.minibatch", "verl.old_log_prob.micro_batch_check",
             "verl.old_log_prob.update_policy", "verl.old_log_prob.entropy"]


class Policy(torch.nn.Module):
    pre_process = post_process = True

    def __init__(self, config):
        from megatron.core.enums import ModelType

        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.emb = torch.nn.Parameter(torch.randn(V, H, generator=g))
        self.out = torch.nn.Parameter(torch.randn(H, V, generator=g))

    def set_input_tensor(self, tensor):
        pass

    def zero_grad_buffer(self):
        for p in self.parameters():
            p.grad = None

    def logits(self, input_ids):
        return torch.tanh(self.emb[input_ids]) @ self.out

    def forward(self, input_ids, attention_mask=None, position_ids=None, packed_seq_params=None):
        return self.logits(input_ids)  # [1, packed tokens, V]: position t scores token t + 1


def _setup():
    import torch.distributed as dist  # noqa: F401
    from megatron.core import parallel_state as mpu

    from verl_patches.core.apply import apply_all
    from verl_patches.patches import load_catalogue

    # Imported before any patch: its `from ... import compute_policy_loss` must see the original, so that
    # undo() between scenarios restores it there too.
    import verl.workers.actor.megatron_actor  # noqa: F401

    apply_all([p for p in load_catalogue() if p.id.startswith("cpu.") and p.applies_on("cpu") and "worker" in p.phases])
    mpu.initialize_model_parallel(1, 1)


# Sequence lengths for the dynamic-batch scenarios: long and short rows alternate, so verl's split by
# tokens (use_dynamic_bsz, DYNAMIC_TOKENS per micro-batch) groups rows out of order and into micro-batches
# of different sizes: [0, 2] (9 + 9 tokens) and [1, 3, 4, 5] (3 + 3 + 9 + 3) on every rank.
VARIED_LENGTHS = (P + R, 3, P + R, 3, P + R, 3)
DYNAMIC_TOKENS = 18


def _batch(rank: int, compare: bool, varied: bool = False):
    from verl.protocol import DataProto

    g = torch.Generator().manual_seed(10 + rank)
    input_ids = torch.randint(0, V, (B, P + R), generator=g)
    attention_mask = torch.ones(B, P + R, dtype=torch.int64)
    attention_mask[0, :2] = 0  # left-padded prompt
    attention_mask[1, -2:] = 0  # short responses: the mask must matter
    attention_mask[2, -4:] = 0
    if varied:
        attention_mask.fill_(1)
        for row, length in enumerate(VARIED_LENGTHS):
            if length < P + R:  # one prompt token (left-padded) and a response of length - 1
                attention_mask[row, :P - 1] = 0
                attention_mask[row, P + length - 1:] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
               "responses": input_ids[:, -R:].clone(), "advantages": torch.randn(B, R, generator=g)}
    if compare:
        # The rollout's log-probs: made up (the test compares the measurement with a direct computation);
        # -1 beyond the response, as verl pads them.
        rollout = -torch.rand(B, R, generator=g) * 3
        rollout[attention_mask[:, -R:] == 0] = -1.0
        tensors["rollout_log_probs"] = rollout
    return DataProto.from_dict(tensors=tensors, meta_info={"micro_batch_size": 2})


def _actor(loss_agg_mode: str, entropy_coeff: float, dynamic: int | None = None, recompute: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from omegaconf import OmegaConf
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    tc = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, use_cpu_initialization=True)
    model = Policy(tc)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        sgd.step()
        return True, 1.0, None

    actor = object.__new__(MegatronPPOActor)  # verl's methods; attributes its __init__ would set
    actor.config = OmegaConf.create({
        "ppo_mini_batch_size": B, "ppo_epochs": 1, "data_loader_seed": 0, "shuffle": False, "use_kl_loss": False,
        "entropy_coeff": entropy_coeff, "ppo_micro_batch_size_per_gpu": 2, "use_dynamic_bsz": dynamic is not None,
        "ppo_max_token_len_per_gpu": dynamic or 0, "recompute_old_log_prob": recompute, "clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None,
        "loss_agg_mode": loss_agg_mode, "policy_loss": {"loss_mode": "vanilla"}, "megatron": {"context_parallel_size": 1},
    })
    actor.actor_module = [model]
    actor.actor_optimizer = types.SimpleNamespace(zero_grad=lambda: None, step=step)
    actor.tf_config = types.SimpleNamespace(sequence_parallel=False)
    actor.hf_config = types.SimpleNamespace(architectures=["DeepseekV3ForCausalLM"])
    actor.prof = types.SimpleNamespace(start=lambda: None, step=lambda: None, stop_and_save=lambda: None,
                                       stop_trace=lambda: None)
    return actor, model


def _direct(model: Policy, data) -> dict:
    """The actor's log-probs and entropy at the response positions, straight from its logits."""
    with torch.no_grad():
        logits = model.logits(data.batch["input_ids"])[:, -R - 1:-1].float()
        logp = torch.log_softmax(logits, -1)
        lp = logp.gather(-1, data.batch["responses"].unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
    return {"log_prob": lp, "entropy": ent, "mask": data.batch["attention_mask"][:, -R:].bool()}


def update(ids: list, compare: bool = True, loss_agg_mode: str = "token-mean", entropy_coeff: float = 0.0,
           strip_requires: bool = False, dynamic: int | None = None, recompute: bool = False) -> dict:
    """One update through verl's real bodies with the patches ``ids`` (undone afterwards); the metrics
    it reports, what a direct computation needs (this rank's chunk) and the weights after the step.
    ``strip_requires``: apply them with their declared requirements dropped (to show what a missing
    patch would do). ``dynamic``: verl's use_dynamic_bsz with that many tokens per micro-batch, on
    the batch of VARIED_LENGTHS. ``recompute``: verl's path without reuse, the old log-probs from its
    own compute_log_prob forward (with the same dynamic split, rows put back in order by verl)."""
    import dataclasses

    from verl_patches.core.apply import apply_all, undo
    from verl_patches.patches import load_catalogue

    reg = {p.id: p for p in load_catalogue()}
    patches = [dataclasses.replace(reg[i], requires=()) if strip_requires else reg[i] for i in ids]
    applied = apply_all(patches)
    try:
        actor, model = _actor(loss_agg_mode, entropy_coeff, dynamic, recompute)
        data = _batch(torch.distributed.get_rank(), compare, varied=dynamic is not None)
        direct = _direct(model, data)
        if compare:
            direct["rollout"] = data.batch["rollout_log_probs"].clone()
        before = [p.detach().clone() for p in model.parameters()]
        if recompute:  # the old-log-prob forward reuse skips: verl's compute_log_prob, as the worker calls it
            data.meta_info.update(micro_batch_size=2, max_token_len=dynamic, use_dynamic_bsz=dynamic is not None)
            old, _ = actor.compute_log_prob(data, calculate_entropy=False)
            data.batch["old_log_probs"] = old
            direct["old_log_probs"] = old.clone()
        try:
            loader = actor.make_minibatch_iterator(data)
            metrics = actor.update_policy(loader)
        except Exception as e:  # noqa: BLE001 - a scenario that must fail reports how (every rank alike)
            moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
            return {"error": f"{type(e).__name__}: {e}", "stepped": moved}
        return {"metrics": dict(metrics), "direct": direct, "after": [p.detach().clone() for p in model.parameters()]}
    finally:
        undo(applied)


SCENARIOS = {
    "token-mean": dict(ids=REUSE_IDS),
    "no rollout log-probs": dict(ids=REUSE_IDS, compare=False),
    "seq-mean-token-mean": dict(ids=REUSE_IDS, loss_agg_mode="seq-mean-token-mean"),
    "seq-mean-token-sum-norm": dict(ids=REUSE_IDS, loss_agg_mode="seq-mean-token-sum-norm"),
    **{f"without {' and '.join(left_out)}": dict(ids=[i for i in REUSE_IDS if i not in left_out], strip_requires=True)
       for left_out in (("verl.old_log_prob.policy_loss",), ("verl.old_log_prob.entropy",),
                        ("verl.old_log_prob.policy_loss", "verl.old_log_prob.entropy"))},
    # Dynamic batch sizes: reuse (comparing with the rollout's log-probs) and verl's own recompute path.
    "dynamic": dict(ids=REUSE_IDS, dynamic=DYNAMIC_TOKENS),
    "dynamic, recomputed": dict(ids=REUSE_IDS, dynamic=DYNAMIC_TOKENS, recompute=True),
    "fixed, recomputed": dict(ids=REUSE_IDS, recompute=True),
}


def all_scenarios(rank: int, world: int) -> dict:
    _setup()
    return {name: update(**kw) for name, kw in SCENARIOS.items()}
