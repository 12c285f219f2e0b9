"""Seeded full DeepSeek-V3 states (HF names) and, from them, one rank's Megatron training shards
and its expected vLLM rollout shards: the ground truth for tests and preflight.

Only for models that fit in memory (the tiny config, benchmark-sized layers).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from verl_patches.reshard.deepseek_v3_names import hf_expert_names, is_expert_stack
from verl_patches.reshard.placements import Placements

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def logical_shapes(placements: Placements) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in placements.tensors}


def full_state(placements: Placements, seed: int = 0, dtype: Any = "bfloat16") -> dict[str, torch.Tensor]:
    """A full model in HF names (routed experts one tensor per expert), values drawn from a
    generator seeded by (seed, name) so that any subset is reproducible on its own."""
    dt = torch_dtype(dtype)
    out: dict[str, torch.Tensor] = {}
    E = placements.model.n_routed_experts
    for t in placements.tensors:
        names = hf_expert_names(t.name, E) if is_expert_stack(t.name) else [t.name]
        shape = t.shape[1:] if is_expert_stack(t.name) else t.shape
        for n in names:
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(n.encode()))
            out[n] = torch.randn(shape, generator=g, dtype=torch.float32).to(dt)
    return out


def logical_state(placements: Placements, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> logical tensors (routed experts stacked on a leading expert dim)."""
    E = placements.model.n_routed_experts
    out = {}
    for t in placements.tensors:
        if is_expert_stack(t.name):
            out[t.name] = torch.stack([hf_state[n] for n in hf_expert_names(t.name, E)])
        else:
            out[t.name] = hf_state[t.name]
        if tuple(out[t.name].shape) != t.shape:
            raise ValueError(f"{t.name}: state has shape {list(out[t.name].shape)}, the config "
                             f"says {list(t.shape)}")
    return out


def _sl(box: Any) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def allocate(shapes: dict[str, tuple[int, ...]], dtype: Any, device: Any = "cpu",
             fill: float | None = None) -> dict[str, torch.Tensor]:
    dt = torch_dtype(dtype)
    if fill is None:
        return {n: torch.empty(s, dtype=dt, device=device) for n, s in shapes.items()}
    return {n: torch.full(s, fill, dtype=dt, device=device) for n, s in shapes.items()}


def _fill(placements: Placements, rank: int, logical: dict[str, torch.Tensor], device: Any, side: str
          ) -> dict[str, torch.Tensor]:
    storage = placements.train_storage if side == "train" else placements.rollout_storage
    out = allocate(storage[rank], next(iter(logical.values())).dtype, device, fill=0.0)
    for t in placements.tensors:
        for part in (t.train if side == "train" else t.rollout):
            if rank in part.ranks:
                part.slot.view(out[part.slot.name]).copy_(logical[t.name][_sl(part.box)])
    return out


def train_shards(placements: Placements, rank: int, logical: dict[str, torch.Tensor],
                 device: Any = "cpu") -> dict[str, torch.Tensor]:
    """The Megatron parameters of ``rank`` (names and storage layout of megatron-core 0.12.1,
    local layer numbering of its PP stage). Vocab padding rows are zero."""
    return _fill(placements, rank, logical, device, "train")


def rollout_shards(placements: Placements, rank: int, logical: dict[str, torch.Tensor],
                   device: Any = "cpu") -> dict[str, torch.Tensor]:
    """The vLLM parameters ``rank`` must hold after the reshard (vLLM 0.9.1 names and layout;
    vocab padding rows zero, as vLLM's weight loader leaves them)."""
    return _fill(placements, rank, logical, device, "rollout")


def random_train_shards(placements: Placements, rank: int, dtype: Any, device: Any = "cpu",
                        seed: int = 0) -> dict[str, torch.Tensor]:
    """Random training shards without a full model (benchmarks), drawn on ``device``: replicas
    of the same part get the same values because each part is drawn from a generator seeded
    by its identity (on the same device type)."""
    dt = torch_dtype(dtype)
    dev = torch.device(device)
    out = allocate(placements.train_storage[rank], dt, dev, fill=0.0)
    for t in placements.tensors:
        for part in t.train:
            if rank in part.ranks:
                g = torch.Generator(device=dev).manual_seed(
                    seed * 1_000_003 + zlib.crc32(f"{t.name}{part.box}".encode()))
                shape = tuple(b - a for a, b in part.box)
                part.slot.view(out[part.slot.name]).copy_(torch.randn(shape, generator=g, device=dev, dtype=dt))
    return out
