"""Test-only fault injection into the rollout's weights right after the reshard, to prove that the
weight fingerprint (verl_patches/reshard/checksum.py) stops the run, naming the step, the rank and the
parameter. Off unless ``VERL_PATCHES_INJECT_FAULT`` is set; never set it in production (the run then
stops at the step it names, by design).

    VERL_PATCHES_INJECT_FAULT=flip,step=3,rank=1[,param=NAME]       one bit of one element flipped
    VERL_PATCHES_INJECT_FAULT=transpose,step=3,rank=0[,param=NAME]  an expert stack written transposed
                                                                    (read back in its own shape: the
                                                                    vLLM-Ascend wake_up bug's shape)

Several faults: separated by ';'.

Without ``param``: flip takes the first rollout parameter by name, transpose the first routed-expert
w13 stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from verl_patches.base import env

ENV = "VERL_PATCHES_INJECT_FAULT"
KINDS = ("flip", "transpose")


class FaultSpecError(ValueError):
    """VERL_PATCHES_INJECT_FAULT does not parse; the message names the variable and the problem."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int
    param: str | None = None


def parse(text: str) -> Fault:
    kind, *rest = [p.strip() for p in text.split(",")]
    if kind not in KINDS:
        raise FaultSpecError(f"{ENV}={text!r}: the fault must be one of {list(KINDS)}, got {kind!r}")
    fields: dict[str, str] = {}
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep or key not in ("step", "rank", "param") or key in fields or not value:
            raise FaultSpecError(f"{ENV}={text!r}: {item!r} is not one of step=N, rank=N, param=NAME (each once)")
        fields[key] = value
    for key in ("step", "rank"):
        if key not in fields:
            raise FaultSpecError(f"{ENV}={text!r}: {key}=N is required")
        if not fields[key].isdigit():
            raise FaultSpecError(f"{ENV}={text!r}: {key} must be a non-negative integer, got {fields[key]!r}")
    return Fault(kind, int(fields["step"]), int(fields["rank"]), fields.get("param"))


def configured() -> list[Fault]:
    """The faults in VERL_PATCHES_INJECT_FAULT (several separated by ';')."""
    text = env.get(ENV) or ""
    return [parse(part) for part in text.split(";") if part.strip()]


def inject_after_reshard(step: Any, rank: int, roll: Mapping[str, torch.Tensor]) -> list[str]:
    """Corrupt the rollout parameters the configured faults name for this step and rank; returns their
    names ([] when nothing was injected)."""
    return [_inject(f, step, rank, roll) for f in configured() if f.rank == rank and f.step == step]


def _inject(fault: Fault, step: Any, rank: int, roll: Mapping[str, torch.Tensor]) -> str:
    if fault.param is not None:
        if fault.param not in roll:
            raise FaultSpecError(f"{ENV}: rank {rank} has no rollout parameter {fault.param!r}")
        name = fault.param
    elif fault.kind == "flip":
        name = sorted(roll)[0]
    else:
        stacks = sorted(n for n in roll if n.endswith("mlp.experts.w13_weight"))
        if not stacks:
            raise FaultSpecError(f"{ENV}: rank {rank} holds no routed-expert w13 stack to transpose")
        name = stacks[0]
    t = roll[name]
    with torch.no_grad():
        if fault.kind == "flip":
            bits = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)
            bits.view(-1)[0] ^= 1
        else:
            if t.dim() != 3:
                raise FaultSpecError(f"{ENV}: {name} has {t.dim()} dims; transpose takes an expert stack [E, rows, cols]")
            t.copy_(t.transpose(1, 2).contiguous().view(t.shape))
    print(f"verl_patches: FAULT INJECTED ({ENV}): {fault.kind} of {name} on rank {rank} at step {step}", flush=True)
    return name
