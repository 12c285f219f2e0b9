"""Rollout-vs-train mismatch and entropy measured inside the update, at no extra forward.

Under old log-prob reuse the update's forward passes are the policy that generated the batch (one
optimizer step per batch, taken after all of them), so comparing their log-probs with the ones the
rollout returned measures what verl's recompute path measures (``training/rollout_probs_diff_*`` in
verl/trainer/ppo/ray_trainer.py) without its forward. Per micro-batch the comparison and the
entropy sums stay on the device (no host sync); after the update one all_gather of a small vector
over the data-parallel group gives every rank the global figures.

Framework-free: torch and torch.distributed only. The patches
(verl_patches/patches/verl/patch_trainer_ppo_core_algos.py, patch_workers_actor_megatron_actor.py,
patch_models_mcore_registry.py) connect it to verl's update.

Definitions, over the tokens of the response mask (a = actor log-prob, r = rollout log-prob):
- ``training/rollout_probs_diff_{mean,max,std}``: |exp(r) - exp(a)|, std unbiased (verl's names
  and definitions);
- ``training/rollout_logprob_abs_diff_{mean,max}``: |a - r|;
- ``training/rollout_kl_k3``: mean of (q - 1) - log q with q = exp(a - r), the k3 estimator of
  KL(rollout || actor) from tokens the rollout sampled (non-negative per token);
- ``actor/entropy``: the actor's entropy over the same logits, aggregated with the actor's
  loss_agg_mode over the whole batch as verl's trainer aggregates its ``entropys``.

How the update split its batch (fixed micro-batches or verl's dynamic ones, ``use_dynamic_bsz``),
recorded per rank by the update's wrapper and reduced over the data-parallel group with the rest:
- ``actor/micro_batches``: micro-batches per rank (the most of any rank; verl's dynamic split
  gives every rank the same count);
- ``actor/micro_batch_rows_{min,max}``: sequences in the smallest and the largest micro-batch;
- ``actor/micro_batch_tokens_max``: the non-padded tokens (attention mask) of the largest.
Every statistic above is a sum over tokens or a max, so it does not depend on how the rows were
split or ordered: verl's dynamic split reorders rows, but every field of a row moves with it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

import torch.distributed as dist

PROBS_DIFF = "training/rollout_probs_diff_"
LOGPROB_DIFF = "training/rollout_logprob_abs_diff_"
KL_K3 = "training/rollout_kl_k3"
ENTROPY = "actor/entropy"
MISMATCH_METRICS = (PROBS_DIFF + "mean", PROBS_DIFF + "max", PROBS_DIFF + "std",
                    LOGPROB_DIFF + "mean", LOGPROB_DIFF + "max", KL_K3)
MICRO_BATCHES = "actor/micro_batches"
MICRO_ROWS = "actor/micro_batch_rows_"
MICRO_TOKENS_MAX = "actor/micro_batch_tokens_max"
MICRO_METRICS = (MICRO_BATCHES, MICRO_ROWS + "min", MICRO_ROWS + "max", MICRO_TOKENS_MAX)
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# Tokens per entropy chunk: the entropy pass's temporaries are a few [chunk, vocab / TP] fp32
# tensors instead of a few copies of the micro-batch's whole logits.
ENTROPY_CHUNK_TOKENS = 1024

# Slots of the per-rank statistics vector (all float32 on the device).
_N, _MEAN, _M2, _PD_MAX, _LP_SUM, _LP_MAX, _K3_SUM, _ENT_NUM, _ENT_DEN = range(9)
_WIDTH = 9
# The split's slots, after the statistics in the gathered vector: count, fewest rows, most rows, most tokens.
_SPLIT_WIDTH = 4


class MismatchError(RuntimeError):
    """The update's measurement did not see what it must (a wrapper did not run, or ran out of order)."""


def check_agg_mode(mode: str) -> str:
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode {mode!r} is not one of verl 0.4.1's {AGG_MODES}")
    return mode


def chunked_entropy(logits: torch.Tensor, entropy_fn: Any, chunk: int = ENTROPY_CHUNK_TOKENS) -> torch.Tensor:
    """``entropy_fn`` (a [tokens, vocab-shard] -> [tokens] entropy, collective over tensor parallel)
    over ``chunk`` tokens at a time, without autograd; shape logits.shape[:-1], float32.
    Every tensor-parallel rank holds the same tokens, so all of them run the same chunks."""
    if chunk < 1:
        raise ValueError(f"entropy chunk must be at least one token, got {chunk}")
    with torch.no_grad():
        flat = logits.detach().reshape(-1, logits.shape[-1])
        parts = [entropy_fn(flat[i:i + chunk]).float() for i in range(0, flat.shape[0], chunk)]
        out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])


class UpdateProbe:
    """Accumulates one update's comparison and entropy on the device.

    ``compare``: the batch carries the rollout's log-probs (rollout.calculate_log_probs=True);
    without them only the entropy is measured. The entropy of a micro-batch is put by the forward
    wrapper and taken by the loss wrapper of the same micro-batch (Megatron's schedules run a
    micro-batch's forward step and its loss function back to back on the last pipeline stage)."""

    def __init__(self, compare: bool, loss_agg_mode: str) -> None:
        self.compare = bool(compare)
        self.loss_agg_mode = check_agg_mode(loss_agg_mode)
        self.calls = 0  # loss calls intercepted (micro-batches compared)
        self._stats: Optional[torch.Tensor] = None
        self._entropy: Optional[torch.Tensor] = None
        self._split: Optional[torch.Tensor] = None

    # -- how the update split the batch ------------------------------------------------------------
    def note_split(self, rows: list[int], tokens_max: torch.Tensor) -> None:
        """The micro-batches of this rank's update: the sequences of each (in the order run) and the
        most non-padded tokens in one of them (a device scalar: no host sync)."""
        if not rows or min(rows) < 1:
            raise MismatchError(f"the update's micro-batches have {rows} sequences: every one must hold at least one")
        split = torch.zeros(_SPLIT_WIDTH, dtype=torch.float32, device=tokens_max.device)
        split[0], split[1], split[2] = float(len(rows)), float(min(rows)), float(max(rows))
        split[3] = tokens_max.detach().float()
        prev = self._split
        if prev is not None:  # another forward_backward_batch in the same update: counts add up
            split = torch.stack([prev[0] + split[0], torch.minimum(prev[1], split[1]),
                                 torch.maximum(prev[2], split[2]), torch.maximum(prev[3], split[3])])
        self._split = split

    # -- entropy hand-over (forward -> loss of one micro-batch) ------------------------------------
    def put_entropy(self, entropy: torch.Tensor) -> None:
        if self._entropy is not None:
            raise MismatchError("a micro-batch's entropy was computed but its loss never took it: the policy "
                                "loss of the previous micro-batch did not run through patch verl.old_log_prob.policy_loss")
        self._entropy = entropy.detach()

    def take_entropy(self, response_width: int) -> torch.Tensor:
        """The stashed entropy [B, prompt + response] of the micro-batch at the response's
        positions, [B, response_width], sliced as verl slices its log-probs (the logit at position
        t scores token t + 1)."""
        if self._entropy is None:
            raise MismatchError("the policy loss ran without the entropy of its micro-batch: the forward did not go "
                                "through patch verl.old_log_prob.entropy (verl.models.mcore.registry:"
                                "get_mcore_forward_fn); apply it, or set actor.recompute_old_log_prob=True")
        e, self._entropy = self._entropy, None
        if e.dim() != 2 or e.shape[1] < response_width + 1:
            raise MismatchError(f"the stashed entropy has shape {tuple(e.shape)}; expected [batch, prompt + response] "
                                f"with a response of {response_width}")
        return e[:, -response_width - 1:-1]

    def pending_entropy(self) -> bool:
        return self._entropy is not None

    # -- per micro-batch ---------------------------------------------------------------------------
    def add(self, log_prob: torch.Tensor, response_mask: torch.Tensor, entropy: torch.Tensor,
            rollout_log_prob: Optional[torch.Tensor] = None, loss_agg_mode: Optional[str] = None) -> None:
        """One micro-batch: actor log-probs [B, R], response mask [B, R], entropy [B, R] and, when
        comparing, the rollout's log-probs [B, R]. Device ops only."""
        if loss_agg_mode is not None and loss_agg_mode != self.loss_agg_mode:
            raise MismatchError(f"the policy loss aggregates with {loss_agg_mode!r} but the actor is configured "
                                f"with {self.loss_agg_mode!r}")
        if self.compare and rollout_log_prob is None:
            raise MismatchError("the batch has the rollout's log-probs but the loss received none")
        with torch.no_grad():
            self._add(log_prob.detach().float(), response_mask.bool(), entropy.detach().float(),
                      None if rollout_log_prob is None else rollout_log_prob.detach().float())
        self.calls += 1

    def _add(self, a: torch.Tensor, m: torch.Tensor, ent: torch.Tensor, r: Optional[torch.Tensor]) -> None:
        if ent.shape != m.shape or a.shape != m.shape or (r is not None and r.shape != m.shape):
            raise MismatchError(f"shapes differ: log_prob {tuple(a.shape)}, mask {tuple(m.shape)}, entropy "
                                f"{tuple(ent.shape)}, rollout {None if r is None else tuple(r.shape)}")
        mf = m.float()
        zero = torch.zeros((), dtype=torch.float32, device=a.device)
        row = torch.zeros(_WIDTH, dtype=torch.float32, device=a.device)
        n = mf.sum()
        row[_N] = n
        if r is not None:
            d = torch.where(m, a - r, zero)
            pd = torch.where(m, (torch.exp(r) - torch.exp(a)).abs(), zero)
            mean = pd.sum() / n.clamp(min=1)
            row[_MEAN] = mean
            row[_M2] = torch.where(m, (pd - mean) ** 2, zero).sum()
            row[_PD_MAX] = pd.max() if pd.numel() else zero
            row[_LP_SUM] = d.abs().sum()
            row[_LP_MAX] = d.abs().max() if d.numel() else zero
            # (q - 1) - log q with q = exp(d), written expm1(d) - d: no cancellation for small d.
            row[_K3_SUM] = torch.where(m, torch.expm1(d) - d, zero).sum()
        ent = torch.where(m, ent, zero)
        tokens = mf.sum(-1)
        mode = self.loss_agg_mode
        if mode == "token-mean":
            row[_ENT_NUM], row[_ENT_DEN] = ent.sum(), n
        elif mode == "seq-mean-token-sum":
            row[_ENT_NUM], row[_ENT_DEN] = ent.sum(), float(m.shape[0])
        elif mode == "seq-mean-token-mean":
            row[_ENT_NUM], row[_ENT_DEN] = (ent.sum(-1) / tokens).sum(), float(m.shape[0])
        else:  # seq-mean-token-sum-norm: the batch's sum over the response width (verl's agg_loss)
            row[_ENT_NUM], row[_ENT_DEN] = ent.sum() / m.shape[-1], 0.0
        self._stats = row if self._stats is None else merge(self._stats, row)

    # -- after the update --------------------------------------------------------------------------
    def local_stats(self, device: Any = None) -> torch.Tensor:
        if self._stats is not None:
            return self._stats
        return torch.zeros(_WIDTH, dtype=torch.float32, device=device)

    def local_split(self, device: Any = None) -> torch.Tensor:
        """The split's slots (zeros when the update's wrapper noted none)."""
        if self._split is not None:
            return self._split
        return torch.zeros(_SPLIT_WIDTH, dtype=torch.float32, device=device)

    def reduce(self, group: Any = None, device: Any = None) -> dict[str, float]:
        """Global metrics: one all_gather of this rank's statistics over ``group`` (the data-parallel
        group; None without torch.distributed: this rank alone). Every rank gets the same figures."""
        stats = self.local_stats(device)
        local = torch.cat([stats, self.local_split(stats.device)])
        if dist.is_available() and dist.is_initialized():
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, local, group=group)
            rows = torch.stack(gathered)
        else:
            rows = local.unsqueeze(0)
        return metrics_from(rows.cpu().double(), self.compare, self.loss_agg_mode)


def merge(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Combine two statistics vectors (Chan et al.'s pairwise update for mean and squared deviations)."""
    out = x + y  # counts, sums
    n = x[_N] + y[_N]
    delta = y[_MEAN] - x[_MEAN]
    safe = n.clamp(min=1)
    out[_MEAN] = x[_MEAN] + delta * y[_N] / safe
    out[_M2] = x[_M2] + y[_M2] + delta * delta * x[_N] * y[_N] / safe
    out[_PD_MAX] = torch.maximum(x[_PD_MAX], y[_PD_MAX])
    out[_LP_MAX] = torch.maximum(x[_LP_MAX], y[_LP_MAX])
    return out


def metrics_from(rows: torch.Tensor, compare: bool, loss_agg_mode: str) -> dict[str, float]:
    """The metrics of stacked per-rank statistics [ranks, width], the split's slots optionally after
    them. A batch without a response token gives NaN, which the run's report refuses to log."""
    split = rows[:, _WIDTH:_WIDTH + _SPLIT_WIDTH]
    rows = rows[:, :_WIDTH]
    total = rows[0].clone()
    for row in rows[1:]:
        total = merge(total, row)
    n = float(total[_N])
    nan = float("nan")
    out: dict[str, float] = {}
    if compare:
        out[PROBS_DIFF + "mean"] = float(total[_MEAN]) if n > 0 else nan
        out[PROBS_DIFF + "max"] = float(total[_PD_MAX]) if n > 0 else nan
        out[PROBS_DIFF + "std"] = math.sqrt(max(float(total[_M2]), 0.0) / (n - 1)) if n > 1 else nan
        out[LOGPROB_DIFF + "mean"] = float(total[_LP_SUM]) / n if n > 0 else nan
        out[LOGPROB_DIFF + "max"] = float(total[_LP_MAX]) if n > 0 else nan
        out[KL_K3] = float(total[_K3_SUM]) / n if n > 0 else nan
    if loss_agg_mode == "seq-mean-token-sum-norm":
        out[ENTROPY] = float(total[_ENT_NUM]) if n > 0 else nan
    else:
        den = float(total[_ENT_DEN])
        out[ENTROPY] = float(total[_ENT_NUM]) / den if den > 0 and n > 0 else nan
    noted = split[split[:, 0] > 0] if split.shape[1] == _SPLIT_WIDTH else split[:0]
    if len(noted):
        out[MICRO_BATCHES] = float(noted[:, 0].max())
        out[MICRO_ROWS + "min"] = float(noted[:, 1].min())
        out[MICRO_ROWS + "max"] = float(noted[:, 2].max())
        out[MICRO_TOKENS_MAX] = float(noted[:, 3].max())
    return out
