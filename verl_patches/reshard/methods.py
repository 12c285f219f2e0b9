"""The reshard methods, by name: what the recipe's `reshard_method` key, the preflight's `--method`
and the benchmarks accept. A leaf module (no torch): settings readers import it."""

from __future__ import annotations

# name -> what it is; the executors live in verl_patches.reshard.executor (direct) and
# verl_patches.reshard.baselines (the two references, for comparison).
METHOD_DOCS: dict[str, str] = {
    "direct": "ours: direct slice routing, one all-to-all per bucket, no full tensor materialised",
    "recipe": "the published recipe's reference: per-layer all-gather, then local slicing",
    "upstream": "verl 0.4.1's path: every parameter gathered to full size on every rank",
}
METHODS: tuple[str, ...] = tuple(METHOD_DOCS)


def check_method(name: str) -> str:
    if name not in METHODS:
        raise ValueError(f"reshard method {name!r}: expected one of {METHODS}")
    return name
