"""The per-process TensorCache: named device tensors of one training step, kept between stages.

Every entry shares one row layout (the global row ids this rank holds); ``relayout`` moves all
entries to a new layout with one all-to-all, or with no communication when nothing changes.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from verl_patches.tensor_cache.exchange import MoveStats, relayout
from verl_patches.tensor_cache.layout import LayoutError


class CacheError(RuntimeError):
    """The cache cannot serve a request (wrong step, missing name, rows that do not match)."""


class TensorCache:
    """Tensors keyed by name, all holding the same rows of the step's batch on this rank."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._rows: torch.Tensor | None = None
        self.step: str | None = None
        self.last_move: MoveStats | None = None

    # -- step ------------------------------------------------------------------------------
    def begin(self, step: str) -> None:
        """Start a step: drop what the previous step left (its tensors are stale now)."""
        self.clear()
        self.step = step

    def check_step(self, step: str) -> None:
        if self.step != step:
            raise CacheError(f"the cache holds step {self.step!r} but the request is for step {step!r}: "
                             "this step's generation outputs are not cached here (worker restarted, or the "
                             "generation ran without the cache)")

    def clear(self) -> None:
        self._tensors.clear()
        self._rows = None
        self.step = None

    # -- contents --------------------------------------------------------------------------
    @property
    def rows(self) -> torch.Tensor | None:
        return self._rows

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def put(self, tensors: Mapping[str, torch.Tensor], rows: torch.Tensor) -> None:
        """Add tensors whose dim 0 are the global rows ``rows``; they must match the cache's layout."""
        rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1).cpu()
        if self._rows is not None and not torch.equal(rows, self._rows):
            raise CacheError(f"new entries {sorted(tensors)} hold other rows than the cached ones "
                             f"{self.names()}: relayout the cache first")
        for name, t in tensors.items():
            if t.dim() == 0 or t.shape[0] != rows.numel():
                raise CacheError(f"{name!r}: {t.shape[0] if t.dim() else 0} rows given for a layout of {rows.numel()} rows")
        self._tensors.update(tensors)
        self._rows = rows

    def get(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        names = list(names)
        missing = [n for n in names if n not in self._tensors]
        if missing:
            raise CacheError(f"not cached: {missing}; cached: {self.names()}")
        return {n: self._tensors[n] for n in names}

    # -- layout change ---------------------------------------------------------------------
    def relayout(self, wanted: torch.Tensor, group: dist.ProcessGroup | None = None,
                 unchanged: bool = False) -> MoveStats:
        """Make this rank hold rows ``wanted`` of every entry. Collective over ``group`` unless
        ``unchanged`` says (identically on every rank) that each rank already holds exactly
        ``wanted``; that claim is checked locally and a wrong one is an error, never a silent mix."""
        wanted = torch.as_tensor(wanted, dtype=torch.int64).reshape(-1).cpu()
        if self._rows is None:
            raise CacheError("relayout of an empty cache")
        if unchanged:
            if not torch.equal(wanted, self._rows):
                raise CacheError("told that the layout is unchanged, but this rank holds other rows than wanted")
            self.last_move = MoveStats(False, 0, 0, 0, 0)
            return self.last_move
        try:
            moved, stats = relayout(self._tensors, self._rows, wanted, group)
        except LayoutError as e:
            raise CacheError(f"cannot move cached {self.names()} to the new layout: {e}") from e
        self._tensors = moved
        self._rows = wanted
        self.last_move = stats
        return stats


_PROCESS_CACHE = TensorCache()


def process_cache() -> TensorCache:
    """The cache of this process. verl co-locates the actor, rollout and reference workers of one
    device in one Ray actor process, so a per-process cache is shared by all roles on the device."""
    return _PROCESS_CACHE
