"""Per-device memory of a recipe layout, estimated from the model config: the training state during the
update and the rollout weights during generation, for the configuration check and docs/NVIDIA.md.

Counts parameters from DeepSeek-V3's config (MLA attention, dense and MoE layers, shared experts, router,
embedding and LM head) and places them as the layouts do (docs/DESIGN.md section 1). Activations, the KV
cache and communication buffers are not counted: the check compares with what must fit besides them. The one
buffer counted is the direct reshard's, a recipe setting (``reshard_bucket_mb``) sized for the links: its
buckets in flight sit beside the training params and the rollout weights at the switch's reshard.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
MIB = 1024**2
# The direct reshard's staging buffers: verl_patches/reshard/direct.py keeps two buckets in flight, each
# holding one bucket's send and receive parts (its stats report exactly this many buckets as peak extra).
RESHARD_BUCKETS_IN_FLIGHT = 2


@dataclass(frozen=True)
class ModelParams:
    attention: int  # per layer
    dense_mlp: int  # per dense layer
    shared_experts: int  # per MoE layer
    router: int  # per MoE layer
    routed_experts: int  # per MoE layer, all experts
    embedding: int
    lm_head: int
    layers: int
    dense_layers: int

    @property
    def total(self) -> int:
        moe = self.layers - self.dense_layers
        return (self.attention * self.layers + self.dense_mlp * self.dense_layers
                + (self.shared_experts + self.router + self.routed_experts) * moe + self.embedding + self.lm_head)


def model_params(cfg: dict) -> ModelParams:
    """Parameter counts of a DeepSeek-V3-shaped config (norms are a rounding error and left out)."""
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    q_lora = cfg.get("q_lora_rank")
    q = h * q_lora + q_lora * heads * qk if q_lora else h * heads * qk
    kv = h * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) + cfg["kv_lora_rank"] * heads * (
        cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
    attention = q + kv + heads * cfg["v_head_dim"] * h
    expert = 3 * h * cfg["moe_intermediate_size"]
    vocab = cfg["vocab_size"]
    return ModelParams(
        attention=attention,
        dense_mlp=3 * h * cfg["intermediate_size"],
        shared_experts=expert * cfg.get("n_shared_experts", 0),
        router=h * cfg["n_routed_experts"],
        routed_experts=expert * cfg["n_routed_experts"],
        embedding=vocab * h,
        lm_head=0 if cfg.get("tie_word_embeddings") else vocab * h,
        layers=cfg["num_hidden_layers"],
        dense_layers=cfg.get("first_k_dense_replace", 0),
    )


def stage_shards(m: ModelParams, *, tp: int, pp: int, expert_group: int,
                 layer_list: list[int] | None) -> list[tuple[float, float]]:
    """Per pipeline stage, the parameters one rank holds: (the dense part, split over TP; the routed experts,
    split over the stage's expert group)."""
    stages = list(layer_list) if layer_list else [m.layers // pp + (1 if s < m.layers % pp else 0) for s in range(pp)]
    out, first = [], 0
    for s, n in enumerate(stages):
        dense_layers = max(0, min(n, m.dense_layers - first))
        moe_layers = n - dense_layers
        first += n
        dense = (m.attention * n + m.dense_mlp * dense_layers + (m.shared_experts + m.router) * moe_layers
                 + (m.embedding if s == 0 else 0) + (m.lm_head if s == len(stages) - 1 else 0)) / tp
        out.append((dense, m.routed_experts * moe_layers / expert_group))
    return out


# Bytes per parameter in one checkpoint of the actor (verl's save_contents model, optimizer, extra): the BF16
# weights (the model's sharded state dict) and megatron-core's distributed optimizer state as it saves it
# (sharding_type fully_sharded_model_space: each parameter's FP32 main weight and Adam's two FP32 moments).
CKPT_WEIGHT_BYTES, CKPT_OPTIMIZER_BYTES = 2, 12


@dataclass(frozen=True)
class CheckpointSize:
    """One checkpoint of the actor, in bytes. Every tensor is written once: the distributed optimizer's state is
    sharded over the data-parallel replicas already, and megatron-core's fully parallel save spreads the writes of
    a replicated weight over its replicas (verl saves with it), so a rank writes about its share of both."""

    weights: float  # all ranks
    optimizer: float
    ranks: int
    per_rank_max: float  # a rank of the heaviest pipeline stage
    per_rank_min: float  # of the lightest

    @property
    def total(self) -> float:
        return self.weights + self.optimizer

    def write_seconds(self, bandwidth_bytes_per_s: float) -> float:
        """The whole checkpoint through one aggregate storage bandwidth (bytes/s)."""
        return self.total / bandwidth_bytes_per_s

    def idle_seconds(self, bandwidth_bytes_per_s: float) -> float:
        """How long the ranks of the lightest stage wait in the save's closing collective for the others, the
        bandwidth shared fairly among the ranks still writing: what is left once they are done, at the full
        bandwidth. A process-group timeout shorter than this fails the save."""
        return (self.total - self.ranks * self.per_rank_min) / bandwidth_bytes_per_s


def checkpoint_size(cfg: dict, *, world: int, tp: int, pp: int, expert_group: int,
                    layer_list: list[int] | None) -> CheckpointSize:
    """The actor's checkpoint on a training layout (the reference is not saved: frozen, it is rebuilt from its
    weights at every start; no MTP layer: the recipe trains without one)."""
    m = model_params(cfg)
    dense_dp, expert_dp = world // (tp * pp), max(world // (expert_group * pp), 1)
    per_rank = [(CKPT_WEIGHT_BYTES + CKPT_OPTIMIZER_BYTES) * (dense / dense_dp + experts / expert_dp)
                for dense, experts in stage_shards(m, tp=tp, pp=pp, expert_group=expert_group, layer_list=layer_list)]
    return CheckpointSize(weights=CKPT_WEIGHT_BYTES * m.total, optimizer=CKPT_OPTIMIZER_BYTES * m.total, ranks=world,
                          per_rank_max=max(per_rank), per_rank_min=min(per_rank))


@dataclass(frozen=True)
class MemoryEstimate:
    params: float  # GiB per device, the heaviest pipeline stage
    grads: float
    optimizer: float  # the whole distributed optimizer state of the device's shard, wherever it lives
    rollout_weights: float
    optimizer_on_host: bool  # all of it on the host
    host_fraction: float = 0.0  # the share of ``optimizer`` on the host
    host_optimizer: float = 0.0  # GiB on the host for that share (with the pinned grad copies if counted)
    reshard_buffers: float = 0.0  # GiB: the direct reshard's buckets in flight

    @property
    def switch_peak(self) -> float:
        """GiB on the device at the reshard (docs/DESIGN.md section 3, our schedule): the training params (the
        source), the rollout weights (allocated, being filled) and the reshard's buckets; the grads are
        released and the optimizer state offloaded before it."""
        return self.params + self.rollout_weights + self.reshard_buffers

    @property
    def device_optimizer(self) -> float:
        return self.optimizer * (1.0 - self.host_fraction)

    @property
    def training_state(self) -> float:
        return self.params + self.grads + self.device_optimizer

    @property
    def host_per_device(self) -> float:
        """Host GiB one device's training process needs: the optimizer's host share, and the switch's pinned
        copies of the training params and of the reference's params (docs/DESIGN.md section 3; the grads
        are released, not copied)."""
        return self.host_optimizer + 2 * self.params

    def as_dict(self) -> dict:
        return {"params_gib": round(self.params, 1), "grads_gib": round(self.grads, 1),
                "optimizer_gib": round(self.optimizer, 1), "optimizer_on_host": self.optimizer_on_host,
                "optimizer_host_fraction": self.host_fraction,
                "device_optimizer_gib": round(self.device_optimizer, 1),
                "training_state_gib": round(self.training_state, 1),
                "rollout_weights_gib": round(self.rollout_weights, 1),
                "reshard_buffers_gib": round(self.reshard_buffers, 2),
                "switch_peak_gib": round(self.switch_peak, 1),
                "host_optimizer_gib": round(self.host_optimizer, 1),
                "host_per_device_gib": round(self.host_per_device, 1)}


# Host bytes per byte of device-side optimizer state (12 bytes per parameter: fp32 master + Adam's two
# moments) when megatron-core's HybridDeviceOptimizer holds it: the same 12 plus its pinned fp32 copy of the
# gradient (4 bytes), filled before every host step (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py).
HYBRID_HOST_RATIO = 16 / 12


def estimate(cfg: dict, *, world: int, tp: int, pp: int, expert_group: int, layer_list: list[int] | None,
             rollout_tp: int, rollout_ep: int, optimizer_on_host: bool = False,
             host_fraction: float | None = None, host_grad_copy: bool = False,
             reshard_bucket_mb: float = 0) -> MemoryEstimate:
    """GiB per device: BF16 params, FP32 main grads (verl builds megatron's DDP with grads reduced in FP32),
    FP32 master weights plus Adam's two moments sharded over each parameter's data-parallel replicas
    (distributed optimizer), all on the heaviest stage; and the BF16 rollout weights of one rank (experts
    over the rollout EP group, the rest split over its TP and replicated).

    ``host_fraction`` of the optimizer state lives on the host (``optimizer_on_host``: all of it, as
    MindSpeed's swap optimizer keeps it); ``host_grad_copy``: the host also holds a pinned fp32 copy of
    those parameters' gradients (megatron-core's HybridDeviceOptimizer). ``reshard_bucket_mb``: the direct
    reshard's bucket (0 for a method whose buffers are not estimated)."""
    fraction = host_fraction if host_fraction is not None else (1.0 if optimizer_on_host else 0.0)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"host_fraction must be in [0, 1], got {fraction!r}")
    m = model_params(cfg)
    dense_dp, expert_dp = world // (tp * pp), max(world // (expert_group * pp), 1)
    worst = None
    for dense, experts in stage_shards(m, tp=tp, pp=pp, expert_group=expert_group, layer_list=layer_list):
        params = dense + experts
        opt = 12 * (dense / dense_dp + experts / expert_dp)
        if worst is None or 2 * params + 4 * params + opt > worst[0]:
            worst = (6 * params + opt, params, opt)
    _, params, opt = worst
    moe_total = m.routed_experts * (m.layers - m.dense_layers)
    rollout = moe_total / rollout_ep + (m.total - moe_total) / rollout_tp
    host_opt = opt * fraction * (HYBRID_HOST_RATIO if host_grad_copy else 1.0)
    return MemoryEstimate(params=2 * params / GIB, grads=4 * params / GIB, optimizer=opt / GIB,
                          rollout_weights=2 * rollout / GIB, optimizer_on_host=fraction == 1.0,
                          host_fraction=fraction, host_optimizer=host_opt / GIB,
                          reshard_buffers=RESHARD_BUCKETS_IN_FLIGHT * reshard_bucket_mb * MIB / GIB)
