"""What a user reads during a run: one line per step, a check that every metric is a number, the
switch's own figures, a JSONL record and a summary at the end.

Framework-free: it takes verl's metrics dict of a step (patch verl.tracking.recipe_report hands it
over) and returns the dict the loggers then receive. The switch figures reach the driver through
verl's only channel from the generation workers, the sharding manager's timing dict, under
``SWITCH_PREFIX`` (verl names them ``timing_s/switch/...``); they are moved to ``switch/...``.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

SWITCH_PREFIX = "switch/"
_TIMED_SWITCH = "timing_s/" + SWITCH_PREFIX

# (label, metric, format) of the per-step line, in order; absent metrics are left out.
LINE = (
    ("reward", "critic/score/mean", "{:.3f}"),
    ("resp_len", "response_length/mean", "{:.1f}"),
    ("pg_loss", "actor/pg_loss", "{:.4f}"),
    ("kl", "actor/kl_loss", "{:.4f}"),
    ("grad_norm", "actor/grad_norm", "{:.3f}"),
    ("gen", "timing_s/gen", "{:.1f}s"),
    ("reshard", "timing_s/reshard", "{:.2f}s"),
    ("ref", "timing_s/ref", "{:.1f}s"),
    ("update", "timing_s/update_actor", "{:.1f}s"),
    ("step", "timing_s/step", "{:.1f}s"),
)
PHASES = ("gen", "reshard", "reward", "ref", "adv", "update_actor", "testing", "save_checkpoint", "step")


class NonFiniteMetricError(ValueError):
    """A metric is NaN or infinite: the run's numbers would be silently wrong from here on."""


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f} MB"


@dataclass
class RunReport:
    total_steps: int
    reuse_old_log_prob: bool = False
    metrics_file: Path | None = None
    out: TextIO = field(default=sys.stdout)
    history: list[dict[str, Any]] = field(default_factory=list)

    def step(self, data: dict[str, Any], step: int) -> dict[str, Any]:
        data = dict(data)
        for key in [k for k in data if k.startswith(_TIMED_SWITCH)]:
            data[SWITCH_PREFIX + key[len(_TIMED_SWITCH):]] = data.pop(key)
        bad = sorted(k for k, v in data.items() if _nonfinite(v))
        if bad:
            raise NonFiniteMetricError(f"step {step}: metric(s) {bad} are not finite "
                                       f"({ {k: data[k] for k in bad} }); stopping before they are logged")
        record = {"step": step, **{k: _plain(v) for k, v in data.items()}}
        self.history.append(record)
        if self.metrics_file is not None:
            self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")
        print(self.line(record), file=self.out, flush=True)
        if step >= self.total_steps:
            print(self.summary(), file=self.out, flush=True)
        return data

    def line(self, record: dict[str, Any]) -> str:
        parts = [f"step {record['step']}/{self.total_steps}"]
        for label, key, fmt in LINE:
            if key in record:
                parts.append(f"{label} {fmt.format(record[key])}")
        switch = {k[len(SWITCH_PREFIX):]: v for k, v in record.items() if k.startswith(SWITCH_PREFIX)}
        if switch:
            parts.append("switch " + ", ".join(
                f"{k.removesuffix('_bytes')} {_mb(v)}" if k.endswith("_bytes") else f"{k} {v:g}"
                for k, v in sorted(switch.items())))
        val = [(k, v) for k, v in record.items() if k.startswith("val-core/")]
        parts += [f"{k.split('/', 1)[1]} {v:.3f}" for k, v in val]
        return " | ".join(parts)

    def summary(self) -> str:
        train = [r for r in self.history if "critic/score/mean" in r]
        if not train:
            return "summary: no training step logged"
        first, last = train[0], train[-1]
        lines = [f"summary: {len(train)} step(s); reward {first['critic/score/mean']:.3f} (step {first['step']}) "
                 f"-> {last['critic/score/mean']:.3f} (step {last['step']})"]
        phases = []
        for p in PHASES:
            vals = [r[f"timing_s/{p}"] for r in train if f"timing_s/{p}" in r]
            if vals:
                phases.append(f"{p} {sum(vals) / len(vals):.2f}s")
        if phases:
            lines.append("mean time per step: " + ", ".join(phases))
        vals = [(k, v) for k, v in last.items() if k.startswith("val-core/")]
        if vals:
            lines.append("validation at the end: " + ", ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in vals))
        if self.metrics_file is not None:
            lines.append(f"metrics per step: {self.metrics_file}")
        return "\n".join(lines)


def _nonfinite(v: Any) -> bool:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return False
    return not math.isfinite(f)


def _plain(v: Any) -> Any:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)
