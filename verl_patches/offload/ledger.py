"""Memory ledger: device bytes resident per offload group after each switch-schedule step,
the peak and where it happened; the public record tests, benchmarks and preflight read.
"""

from __future__ import annotations

import collections
import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class LedgerEntry:
    """One step of one iteration. Bytes come from the groups' own storages, so the entry is
    exact on every device; ``measured_*`` are the allocator's numbers (None on CPU)."""

    schedule: str
    iteration: int
    step: str
    resident: dict[str, int]          # device bytes per group at the end of the step
    total: int                        # sum of resident
    step_peak: int                    # highest total seen inside the step (after each action)
    step_peak_resident: dict[str, int]
    h2d_bytes: int
    d2h_bytes: int
    seconds: float
    measured_allocated: int | None = None
    measured_peak: int | None = None
    measured_reserved_peak: int | None = None  # the caching allocator's reserved peak (None on CPU)
    error: str | None = None


@dataclass
class MemoryLedger:
    """Entries (the newest ``max_entries``) plus the all-time peak, which survives trimming."""

    max_entries: int = 4096
    entries: collections.deque = field(default_factory=collections.deque)
    peak_bytes: int = 0
    peak_step: str | None = None
    peak_iteration: int | None = None
    peak_resident: dict[str, int] = field(default_factory=dict)
    measured_peak_bytes: int | None = None
    measured_peak_step: str | None = None
    moved_bytes: int = 0  # host-link bytes of every entry ever recorded (survives trimming)

    def record(self, entry: LedgerEntry) -> None:
        self.moved_bytes += entry.h2d_bytes + entry.d2h_bytes
        self.entries.append(entry)
        while len(self.entries) > self.max_entries:
            self.entries.popleft()
        if entry.step_peak > self.peak_bytes or self.peak_step is None:
            self.peak_bytes, self.peak_step = entry.step_peak, entry.step
            self.peak_iteration, self.peak_resident = entry.iteration, dict(entry.step_peak_resident)
        if entry.measured_peak is not None and (self.measured_peak_bytes is None
                                                or entry.measured_peak > self.measured_peak_bytes):
            self.measured_peak_bytes, self.measured_peak_step = entry.measured_peak, entry.step

    @property
    def last(self) -> LedgerEntry | None:
        return self.entries[-1] if self.entries else None

    def step_peaks(self, iteration: int | None = None) -> dict[str, int]:
        """Highest in-step total per step name (over all kept entries, or one iteration)."""
        out: dict[str, int] = {}
        for e in self.entries:
            if iteration is None or e.iteration == iteration:
                out[e.step] = max(out.get(e.step, 0), e.step_peak)
        return out

    def moved(self, iteration: int | None = None) -> tuple[int, int]:
        """(host->device, device->host) bytes over kept entries, or one iteration."""
        es = [e for e in self.entries if iteration is None or e.iteration == iteration]
        return sum(e.h2d_bytes for e in es), sum(e.d2h_bytes for e in es)

    def reset(self) -> None:
        self.entries.clear()
        self.peak_bytes, self.peak_step, self.peak_iteration, self.peak_resident = 0, None, None, {}
        self.measured_peak_bytes = self.measured_peak_step = None

    def summary(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "peak_step": self.peak_step,
                "peak_iteration": self.peak_iteration, "peak_resident": dict(self.peak_resident),
                "measured_peak_bytes": self.measured_peak_bytes,
                "measured_peak_step": self.measured_peak_step}

    def to_json(self) -> str:
        return json.dumps({"summary": self.summary(), "entries": [asdict(e) for e in self.entries]})

    def format_table(self, unit: int = 1 << 20, unit_name: str = "MiB") -> str:
        """Steps as rows, groups as columns, in ``unit``; the peak row is marked."""
        if not self.entries:
            return "(empty ledger)"
        groups = list(self.entries[0].resident)
        head = ["iter", "step"] + groups + ["total", "step peak", "h2d", "d2h", "error"]
        rows = [head]
        for e in self.entries:
            mark = " *" if (e.step == self.peak_step and e.iteration == self.peak_iteration) else ""
            rows.append([str(e.iteration), e.step + mark]
                        + [f"{e.resident.get(g, 0) / unit:.1f}" for g in groups]
                        + [f"{e.total / unit:.1f}", f"{e.step_peak / unit:.1f}",
                           f"{e.h2d_bytes / unit:.1f}", f"{e.d2h_bytes / unit:.1f}", e.error or ""])
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return f"(bytes in {unit_name}; * = peak)\n" + "\n".join(lines)
