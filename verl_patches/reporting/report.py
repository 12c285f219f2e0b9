"""What a user reads during a run: one line per step, a check that every metric is a number, the
switch's own figures, the throughput per card, a JSONL record and a summary at the end.

Framework-free: it takes verl's metrics dict of a step (patch verl.tracking.report hands it over)
and returns the dict the loggers then receive (the JSONL record, tensorboard and the other backends
get the same dict). The switch figures reach the driver through verl's only channel from the
generation workers, the sharding manager's timing dict, under ``SWITCH_PREFIX`` (verl names them
``timing_s/switch/...``); they are moved to ``switch/...``.

``perf/tps_per_card`` is the reference's figure: prompt + response tokens of the step's batch / the
step's time / the cards. A card is 2 devices (dies) on Ascend A3 and 1 GPU on NVIDIA; verl's own
``perf/throughput`` is the same count per device (per die on Ascend), so on A3 the per-card figure is
twice verl's. On the CPU platform each worker counts as one device and one card.

``CONSOLE_LINE`` matches every line the report prints: a launcher that keeps only the report's
lines on the console (scripts/cluster/launch.sh, LAUNCH_CONSOLE=steps) selects them with it
(``python -m verl_patches.reporting.console``).
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

SWITCH_PREFIX = "switch/"
_TIMED_SWITCH = "timing_s/" + SWITCH_PREFIX
# The generation's own figures, through the same channel (the rollout's rebalance: rollout/rebalance_*,
# verl_patches/rollout/long_tail/migrate.py); moved to ``rollout/...``.
ROLLOUT_PREFIX = "rollout/"
_TIMED_ROLLOUT = "timing_s/" + ROLLOUT_PREFIX

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
TPS_PER_CARD = "perf/tps_per_card"
# Device-memory watermarks of the switch loop's steps (patch verl.sharding_manager.reshard):
# ``switch/mem/<step>/allocated_peak_bytes`` and ``.../reserved_peak_bytes``, and their maxima.
MEM_PREFIX = SWITCH_PREFIX + "mem/"
DEVICE_PEAKS = (SWITCH_PREFIX + "device_allocated_peak_bytes", SWITCH_PREFIX + "device_reserved_peak_bytes")
# Devices per card by verl's trainer.device: an Ascend A3 card holds 2 dies (each one device to verl).
DEVICES_PER_CARD = {"npu": 2, "cuda": 1, "cpu": 1}
# The heads of the report's lines (what ``CONSOLE_LINE`` selects from a trainer's whole output).
HEADS = ("summary: ", "mean time per step: ", "throughput: ", "switch peaks: ", "validation at the end: ",
         "metrics per step: ", "report: ")
CONSOLE_LINE = re.compile(r"^(?:step \d+/\d+ \| |" + "|".join(re.escape(h) for h in HEADS) + ")")


class NonFiniteMetricError(ValueError):
    """A metric is NaN or infinite: the run's numbers would be silently wrong from here on."""


class MetricsFileError(ValueError):
    """The run's JSONL record cannot be written where the setting says."""


class CardsError(ValueError):
    """The devices of a run do not make whole cards: the per-card throughput would be wrong."""


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f} MB"


def _gb(x: float) -> str:
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else _mb(x)


@dataclass(frozen=True)
class Cards:
    """What ``perf/tps_per_card`` divides by: ``devices`` (verl's GPUs: nnodes x n_gpus_per_node) in
    cards of ``per_card`` devices each, and how that was decided (``why``, printed by the report)."""

    devices: int
    per_card: int
    why: str

    def __post_init__(self) -> None:
        if self.devices < 1 or self.per_card < 1 or self.devices % self.per_card:
            raise CardsError(f"{self.devices} device(s) in cards of {self.per_card} ({self.why}) do not make whole "
                             "cards: set actor_rollout_ref.rollout.recipe.devices_per_card to the devices of one card")

    @property
    def count(self) -> int:
        return self.devices // self.per_card

    @classmethod
    def of(cls, devices: int, trainer_device: str | None, platform: str, setting: int | None = None) -> "Cards":
        """Cards of a run: the setting if given, else by verl's ``trainer.device`` (npu: 2 dies per card,
        cuda: 1 GPU); on the CPU platform (``platform``, the driver's, with a trainer.device other than npu:
        the CPU run's launcher asks Ray for GPU slots) each worker is one device and one card."""
        if setting is not None:
            return cls(devices, setting, f"recipe.devices_per_card={setting}")
        kind = (trainer_device or platform).lower()
        # verl's trainer.device first: Ray may hide the accelerator from verl's driver process itself.
        if platform == "cpu" and kind != "npu":
            return cls(devices, 1, "CPU platform (no accelerator in the driver): each worker counts as one device "
                                   "and one card")
        if kind not in DEVICES_PER_CARD:
            raise CardsError(f"trainer.device={kind!r}: no card size known for it (known: {sorted(DEVICES_PER_CARD)});"
                             " set actor_rollout_ref.rollout.recipe.devices_per_card")
        what = "an Ascend A3 card holds 2 dies" if kind == "npu" else "one GPU per card"
        return cls(devices, DEVICES_PER_CARD[kind], f"trainer.device={kind}: {what}")

    def describe(self) -> str:
        return (f"{TPS_PER_CARD} = (prompt + response tokens) / step time / {self.count} card(s) "
                f"({self.devices} device(s), {self.per_card} per card; {self.why})")


def tps_per_card(data: dict[str, Any], cards: Cards) -> float | None:
    """The reference's throughput per card from verl's figures of a step (None without them): verl's
    ``perf/total_num_tokens`` counts prompt + response tokens (the attention mask), ``perf/time_per_step``
    is the step's time."""
    tokens, seconds = data.get("perf/total_num_tokens"), data.get("perf/time_per_step")
    if tokens is None or seconds is None or not float(seconds) > 0:
        return None
    return float(tokens) / float(seconds) / cards.count


@dataclass
class RunReport:
    total_steps: int
    metrics_file: Path | None = None
    out: TextIO = field(default_factory=lambda: sys.stdout)
    history: list[dict[str, Any]] = field(default_factory=list)
    cards: Cards | None = None
    tensorboard_dir: str | None = None

    def __post_init__(self) -> None:
        if self.metrics_file is not None:  # checked now, not after the first validation
            try:
                self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
                with open(self.metrics_file, "a"):
                    pass
            except OSError as e:
                raise MetricsFileError(f"actor_rollout_ref.rollout.recipe.metrics_file={self.metrics_file}: cannot "
                                       f"write it ({e.strerror}); give a writable path or null") from None

    def header(self) -> str:
        """The report's first line: what the figures mean and where they go."""
        parts = [self.cards.describe()] if self.cards is not None else []
        if self.metrics_file is not None:
            parts.append(f"JSONL {self.metrics_file}")
        if self.tensorboard_dir is not None:
            parts.append(f"tensorboard {self.tensorboard_dir}")
        return "report: " + ("; ".join(parts) if parts else "one line per step")

    def step(self, data: dict[str, Any], step: int) -> dict[str, Any]:
        data = dict(data)
        for timed, prefix in ((_TIMED_SWITCH, SWITCH_PREFIX), (_TIMED_ROLLOUT, ROLLOUT_PREFIX)):
            for key in [k for k in data if k.startswith(timed)]:
                data[prefix + key[len(timed):]] = data.pop(key)
        if self.cards is not None:
            tps = tps_per_card(data, self.cards)
            if tps is not None:
                data[TPS_PER_CARD] = tps
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
        if TPS_PER_CARD in record:
            parts.append(f"tps/card {record[TPS_PER_CARD]:.1f}")
        switch = {k[len(SWITCH_PREFIX):]: v for k, v in record.items()
                  if k.startswith(SWITCH_PREFIX) and not k.startswith(MEM_PREFIX) and k not in DEVICE_PEAKS}
        if switch:
            parts.append("switch " + ", ".join(
                f"{k.removesuffix('_bytes')} {_mb(v)}" if k.endswith("_bytes") else f"{k} {v:g}"
                for k, v in sorted(switch.items())))
        if DEVICE_PEAKS[0] in record:
            parts.append(f"device peak {_gb(record[DEVICE_PEAKS[0]])} allocated, "
                         f"{_gb(record.get(DEVICE_PEAKS[1], 0.0))} reserved")
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
        tps = [r[TPS_PER_CARD] for r in train if TPS_PER_CARD in r]
        if tps and self.cards is not None:
            lines.append(f"throughput: {sum(tps) / len(tps):.1f} tokens/s per card on average, {tps[-1]:.1f} at the "
                         f"last step ({TPS_PER_CARD}, {self.cards.count} card(s): {self.cards.why})")
        peaks = [(r[DEVICE_PEAKS[0]], r.get(DEVICE_PEAKS[1], 0.0)) for r in train if DEVICE_PEAKS[0] in r]
        ledger = [r[SWITCH_PREFIX + "ledger_peak_bytes"] for r in train if SWITCH_PREFIX + "ledger_peak_bytes" in r]
        if peaks or ledger:
            what = [f"offload ledger {_gb(max(ledger))}"] if ledger else []
            if peaks:
                what.append(f"device {_gb(max(a for a, _ in peaks))} allocated, {_gb(max(b for _, b in peaks))} "
                            "reserved")
            lines.append("switch peaks: " + ", ".join(what))
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
