"""The vLLM data-parallel domain of one rank: DP rank, DP group, master address and a distinct port.

Pure arithmetic over (global rank, world, rollout TP, DP size, instances), laid out the way
vLLM 0.9.1's initialize_model_parallel lays out ranks (ExternalDP x DP x PP x TP, PP = 1 here).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

from verl_patches.config import settings
from verl_patches.base.ports import overlaps_ephemeral, taken_ports

logger = logging.getLogger(__name__)

# recipe.vllm_dp's defaults, declared with its keys (verl_patches/config/settings.py: VLLM_DP). The port
# stride is how many consecutive ports one DP group may consume. vLLM 0.9.1 takes the next port from
# ParallelConfig.get_next_dp_init_port twice per engine (init_distributed_environment, then
# the engine's stateless DP group); vLLM-Ascend's replacement returns VLLM_DP_MASTER_PORT
# every time. Four leaves room for one extra rendezvous without overlapping the next group.
DEFAULT_PORT_STRIDE = settings.VLLM_DP["port_stride"].default
DEFAULT_MASTER_PORT_BASE = settings.VLLM_DP["master_port_base"].default
MAX_PORT = 65535

# The rollout patch publishes the domain's shape here so vLLM-side code (the parallel-state
# check, run in vLLM's worker init) can re-derive it without verl's config.
DOMAIN_ENV = "VERL_PATCHES_VLLM_DP_DOMAIN"


class DPDomainError(ValueError):
    """The requested DP domain does not fit the world, or vLLM built something else."""


@dataclass(frozen=True)
class DPSpec:
    """The shape every rank shares: what the YAML says."""

    tp_size: int
    dp_size: int
    instances: int = settings.VLLM_DP["instances"].default
    master_port_base: int = DEFAULT_MASTER_PORT_BASE
    port_stride: int = DEFAULT_PORT_STRIDE

    def __post_init__(self) -> None:
        for name in ("tp_size", "dp_size", "instances", "port_stride"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise DPDomainError(f"vLLM DP domain: {name} must be a positive integer, got {v!r}")
        b = self.master_port_base
        if not isinstance(b, int) or isinstance(b, bool) or not 1024 <= b <= MAX_PORT:
            raise DPDomainError(f"vLLM DP domain: master_port_base must be an integer port in [1024, {MAX_PORT}], "
                                f"got {b!r}")
        last = b + self.num_groups * self.port_stride - 1
        if last > MAX_PORT:
            raise DPDomainError(f"vLLM DP domain: {self.num_groups} DP groups x port stride {self.port_stride} "
                                f"from master_port_base {b} need ports up to {last} > {MAX_PORT}")

    @property
    def world_size(self) -> int:
        return self.instances * self.dp_size * self.tp_size

    @property
    def num_groups(self) -> int:
        """DP groups in the world: one per (instance, TP rank)."""
        return self.instances * self.tp_size

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "DPSpec | None":
        raw = (os.environ if environ is None else environ).get(DOMAIN_ENV, "").strip()
        if not raw:
            return None
        try:
            fields = json.loads(raw)
            return cls(**fields)
        except (json.JSONDecodeError, TypeError) as e:
            raise DPDomainError(f"{DOMAIN_ENV}={raw!r} is not a DP domain description: {e}") from e


@dataclass(frozen=True)
class DPDomain:
    """One rank's place in the domain."""

    spec: DPSpec
    global_rank: int
    instance: int
    dp_rank: int  # VLLM_DP_RANK: the rank inside its DP group
    tp_rank: int
    group_index: int  # 0 .. instances * tp - 1, one per DP group
    dp_group: tuple[int, ...]  # global ranks of the DP group, by DP rank (vLLM's _DP group)
    ep_group: tuple[int, ...]  # global ranks of the instance: EP = DP x TP (vLLM's _EP group)
    master_port: int  # VLLM_DP_MASTER_PORT, the same for every member, distinct per group

    @property
    def master_rank(self) -> int:
        """The global rank that hosts the DP group's rendezvous (DP rank 0)."""
        return self.dp_group[0]

    def env(self, master_addr: str) -> dict[str, str]:
        """The VLLM_DP_* variables vLLM's ParallelConfig reads in the offline SPMD case."""
        if not master_addr:
            raise DPDomainError("vLLM DP domain: empty master address")
        return {
            "VLLM_DP_SIZE": str(self.spec.dp_size),
            "VLLM_DP_RANK": str(self.dp_rank),
            # Only used to pick devices when vLLM starts its own DP engines; one engine per
            # process here, so it follows vLLM's own default (the DP rank).
            "VLLM_DP_RANK_LOCAL": str(self.dp_rank),
            "VLLM_DP_MASTER_IP": master_addr,
            "VLLM_DP_MASTER_PORT": str(self.master_port),
            DOMAIN_ENV: self.spec.to_env(),
        }


def derive_dp_domain(global_rank: int, world_size: int, spec: DPSpec) -> DPDomain:
    """Where ``global_rank`` sits. Every member of a DP group derives the same group and port."""
    if not isinstance(world_size, int) or world_size != spec.world_size:
        raise DPDomainError(f"vLLM DP domain: {spec.instances} instance(s) x DP{spec.dp_size} x TP{spec.tp_size} "
                            f"= {spec.world_size} ranks, but the world has {world_size}")
    if not isinstance(global_rank, int) or not 0 <= global_rank < world_size:
        raise DPDomainError(f"vLLM DP domain: global rank {global_rank!r} is outside the world of {world_size}")
    per_instance = spec.dp_size * spec.tp_size
    instance, inner = divmod(global_rank, per_instance)
    dp_rank, tp_rank = divmod(inner, spec.tp_size)
    first = instance * per_instance
    group_index = instance * spec.tp_size + tp_rank
    return DPDomain(
        spec=spec,
        global_rank=global_rank,
        instance=instance,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        group_index=group_index,
        dp_group=tuple(first + d * spec.tp_size + tp_rank for d in range(spec.dp_size)),
        ep_group=tuple(range(first, first + per_instance)),
        master_port=spec.master_port_base + group_index * spec.port_stride,
    )


def master_addr_of(domain: DPDomain, addresses: Sequence[str]) -> str:
    """The host of the DP group's rendezvous, from every rank's address (indexed by global rank)."""
    if len(addresses) != domain.spec.world_size:
        raise DPDomainError(f"vLLM DP domain: {len(addresses)} addresses for a world of {domain.spec.world_size}")
    addr = addresses[domain.master_rank]
    if not addr:
        raise DPDomainError(f"vLLM DP domain: rank {domain.master_rank} reported no address")
    return str(addr)


def check_vllm_config(domain: DPDomain, data_parallel_size: int, data_parallel_rank: int,
                      tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """vLLM's parallel config must carry this rank's domain before it builds its groups."""
    problems = []
    if pipeline_parallel_size != 1:
        problems.append(f"pipeline_parallel_size is {pipeline_parallel_size}; the recipe's DP domain assumes 1")
    if tensor_parallel_size != domain.spec.tp_size:
        problems.append(f"tensor_parallel_size is {tensor_parallel_size}, the domain's TP is {domain.spec.tp_size}")
    if data_parallel_size != domain.spec.dp_size:
        problems.append(f"data_parallel_size is {data_parallel_size}, the domain's DP is {domain.spec.dp_size} "
                        "(was the vLLM config built before VLLM_DP_SIZE was set?)")
    if data_parallel_rank != domain.dp_rank:
        problems.append(f"data_parallel_rank is {data_parallel_rank}, global rank {domain.global_rank} has DP rank "
                        f"{domain.dp_rank} in the domain")
    if problems:
        raise DPDomainError(f"vLLM parallel config on global rank {domain.global_rank} does not match the recipe's "
                            "DP domain: " + "; ".join(problems))


def check_vllm_groups(domain: DPDomain, dp_ranks: Sequence[int], ep_ranks: Sequence[int],
                      tp_ranks: Sequence[int]) -> None:
    """The groups vLLM built must be the domain's: the DP agreement and the ports rely on it."""
    tp_expected = tuple(domain.global_rank - domain.tp_rank + t for t in range(domain.spec.tp_size))
    problems = []
    for name, got, want in (("DP", dp_ranks, domain.dp_group), ("EP", ep_ranks, domain.ep_group),
                            ("TP", tp_ranks, tp_expected)):
        if tuple(got) != want:
            problems.append(f"{name} group {list(got)} != {list(want)}")
    if problems:
        raise DPDomainError(f"vLLM built groups on global rank {domain.global_rank} that differ from the recipe's "
                            "DP domain: " + "; ".join(problems))


def check_master_ports(domain: DPDomain, host: str) -> str:
    """On a DP group's master: why its port block cannot host the group's rendezvous ('' if it can).

    A taken port makes the master's rendezvous fail while the group's other members wait in it
    (until vLLM's store timeout), so it is found before vLLM starts. A block inside the kernel's
    ephemeral range is allowed but warned about: outgoing connections may take one of its ports
    at any moment.
    """
    if domain.global_rank != domain.master_rank:
        return ""
    base, count = domain.master_port, domain.spec.port_stride
    if overlaps_ephemeral(base, count):
        logger.warning("vLLM DP domain: DP group %d's ports %d-%d lie in this host's ephemeral port range; "
                       "an outgoing connection may take one before the rendezvous binds it (choose "
                       "recipe.vllm_dp.master_port_base below it)", domain.group_index, base, base + count - 1)
    taken = taken_ports(base, count)
    if not taken:
        return ""
    return (f"DP group {domain.group_index} (master: global rank {domain.global_rank} on {host}) needs ports "
            f"{base}-{base + count - 1}, but {taken} {'is' if len(taken) == 1 else 'are'} in use there")


def setup_dp_domain(spec: DPSpec, local_addr: str, environ: dict | None = None, group=None) -> DPDomain:
    """Derive this rank's domain, learn its DP master's address, and publish the VLLM_DP_* variables.

    Collective over ``group`` (default: the job's world group, which verl has initialised):
    every rank contributes its address once, so each DP group's members name the same host,
    the one of their DP rank 0, whose process hosts the rendezvous on the group's port. Each
    master also reports whether its ports are free, so that a taken port is an error on every
    rank at once rather than a hang in vLLM's rendezvous.
    """
    # Lazy: torch.distributed when the domain is agreed on (the derivation runs without torch).
    import torch.distributed as dist

    domain = derive_dp_domain(dist.get_rank(group), dist.get_world_size(group), spec)
    reports: list = [None] * spec.world_size
    dist.all_gather_object(reports, (str(local_addr), check_master_ports(domain, str(local_addr))), group=group)
    problems = [problem for _, problem in reports if problem]
    if problems:
        raise DPDomainError("vLLM DP domain: " + "; ".join(problems) + " (change recipe.vllm_dp.master_port_base "
                            "or free the ports)")
    env = domain.env(master_addr_of(domain, [addr for addr, _ in reports]))
    (os.environ if environ is None else environ).update(env)
    return domain
