"""Boxes: a tensor region as one (start, stop) range per dimension, and the arithmetic the
planner and the executors share. A leaf module: it imports nothing from the package."""

from __future__ import annotations

import math
from typing import Iterable

Box = tuple[tuple[int, int], ...]


def box_numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def full_box(shape: Iterable[int]) -> Box:
    return tuple((0, n) for n in shape)


def intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def split_box(box: Box, max_elems: int) -> list[Box]:
    """Cut a box into boxes of at most max_elems elements along its leading dims, so that a
    slice larger than a bucket (a vocab shard, a big expert stack) streams through buckets."""
    n = box_numel(box)
    if n <= max_elems:
        return [box]
    for d, (a, b) in enumerate(box):
        inner = math.prod(y - x for x, y in box[d + 1:])
        if b - a > 1 and inner <= max_elems:
            step = max(1, max_elems // inner)
            return [box[:d] + ((i, min(i + step, b)),) + box[d + 1:] for i in range(a, b, step)]
        if b - a > 1:
            # even one index of this dim is too big: split every index further
            return [piece for i in range(a, b)
                    for piece in split_box(box[:d] + ((i, i + 1),) + box[d + 1:], max_elems)]
    raise ValueError(f"cannot split box {box} to {max_elems} elements")  # pragma: no cover
