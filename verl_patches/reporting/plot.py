"""``python -m verl_patches plot RUN_DIR``: the run's curves as PNGs (matplotlib), from its
``metrics.jsonl`` (verl_patches/reporting/report.py writes it) or, without one, from its tensorboard event files.

RUN_DIR is what a run writes into (scripts/train_tiny.sh's TINY_OUT): ``metrics.jsonl`` and/or
``tensorboard/`` (event files anywhere below it; RUN_DIR itself may be a tensorboard directory).
Written to RUN_DIR/plots (``--out``), each figure only when its metrics are in the run:

- reward.png: the reward and the response length per step (validation scores as points);
- phases.png: seconds per phase of each step, stacked (generation less the reshard, the reshard,
  reward, old log-prob, reference, advantage, update, validation, checkpoint, the rest);
- switch.png: the switch's bytes per step (reshard sent and received, host link) and its peaks
  (the offload ledger's resident peak, the device's allocated and reserved watermarks);
- mismatch.png: rollout-vs-training mismatch per step (``training/rollout_probs_diff_*``,
  ``training/rollout_logprob_abs_diff_*``, ``training/rollout_kl_k3``), ``actor/entropy`` and the
  switch's weight fingerprints (``switch/fingerprint_*``);
- throughput.png: ``perf/tps_per_card`` (the reference's figure) and verl's ``perf/throughput``.

A figure whose metrics are absent is skipped and said so. Bad input (no RUN_DIR, nothing to read,
a malformed line) is a PlotError naming it; the CLI prints it and exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from verl_patches.base.schema import PathArg

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOTS_DIR = "plots"

# Stacked phases: (label, how to get the seconds from a record).
_REST = "rest of the step"
MISMATCH_FAMILIES = (
    ("rollout vs training probabilities", ("training/rollout_probs_diff_",)),
    ("rollout vs training log-probs", ("training/rollout_logprob_abs_diff_",)),
    ("rollout vs training KL (k3)", ("training/rollout_kl_k3",)),
    ("entropy", ("actor/entropy",)),
    ("switch weight fingerprints", ("switch/fingerprint_",)),
)


class PlotError(ValueError):
    """The run directory cannot be plotted; the message names what is missing or wrong."""


@dataclass
class Series:
    """Metric name -> {step: value} for the training steps, read from one source."""

    source: Path
    values: dict[str, dict[int, float]] = field(default_factory=dict)

    def get(self, key: str) -> dict[int, float]:
        return self.values.get(key, {})

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.values if k.startswith(prefix))

    @property
    def steps(self) -> list[int]:
        return sorted({s for v in self.values.values() for s in v})


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def read_jsonl(path: Path) -> Series:
    """The report's record: one JSON object with ``step`` per line (a step logged twice keeps its last)."""
    out = Series(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PlotError(f"cannot read {path}: {e.strerror}") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PlotError(f"{path} line {n} is not JSON ({e.msg}); the report writes one object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise PlotError(f"{path} line {n} has no integer 'step'; the report writes {{\"step\": N, ...}} per line")
        for k, v in row.items():
            x = _number(v)
            if k != "step" and x is not None:
                out.values.setdefault(k, {})[row["step"]] = x
    if not out.values:
        raise PlotError(f"{path} holds no metrics (is the run still starting?)")
    return out


def event_dirs(root: Path) -> list[Path]:
    """Directories under ``root`` (itself included) holding tensorboard event files."""
    return sorted({p.parent for p in root.rglob("events.out.tfevents.*") if p.is_file()})


def read_tensorboard(root: Path) -> Series:
    """Every scalar of the event files under ``root`` (tensorboard's EventAccumulator)."""
    try:
        # Lazy: matplotlib and tensorboard are optional and slow to import; only drawing and reading event files need
        # them.
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise PlotError(f"reading the event files under {root} needs tensorboard (requirements.txt)") from None

    dirs = event_dirs(root)
    if not dirs:
        raise PlotError(f"no tensorboard event files under {root}")
    out = Series(root)
    for d in dirs:
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                x = _number(ev.value)
                if x is not None:
                    out.values.setdefault(tag, {})[int(ev.step)] = x
    if not out.values:
        raise PlotError(f"the tensorboard event files under {root} hold no scalars")
    return out


def read_run(run_dir: Path) -> Series:
    """The run's metrics: RUN_DIR/metrics.jsonl, else the tensorboard event files below RUN_DIR."""
    if not run_dir.exists():
        raise PlotError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir} is not a directory (give the run's output directory, e.g. TINY_OUT)")
    jsonl = run_dir / METRICS_FILE
    if jsonl.is_file():
        return read_jsonl(jsonl)
    if event_dirs(run_dir):
        return read_tensorboard(run_dir)
    raise PlotError(f"{run_dir} has no {METRICS_FILE} and no tensorboard event files (set "
                    "actor_rollout_ref.rollout.recipe.metrics_file, or trainer.logger with 'tensorboard')")


# -- figures -------------------------------------------------------------------------------------------
def _train_steps(s: Series) -> list[int]:
    return [t for t in s.steps if t > 0]


def _bytes_unit(s: Series, keys: list[str]) -> tuple[str, float]:
    top = max((v for k in keys for v in s.get(k).values()), default=0.0)
    return ("GiB", 2**-30) if top >= 2**30 else ("MB", 1e-6)


def _line(ax: Any, s: Series, key: str, label: str | None = None, scale: float = 1.0, **kw: Any) -> bool:
    pts = sorted((t, v) for t, v in s.get(key).items() if t > 0)
    if not pts:
        return False
    # Lazy: matplotlib and tensorboard are optional and slow to import; only drawing and reading event files need them.
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.plot([t for t, _ in pts], [v * scale for _, v in pts], marker="o", markersize=3, label=label or key, **kw)
    return True


def fig_reward(s: Series, plt: Any) -> Any:
    if not s.get("critic/score/mean") and not s.get("response_length/mean"):
        return None
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    _line(a1, s, "critic/score/mean", "reward (mean)")
    for key in s.keys("val-core/"):
        pts = sorted(s.get(key).items())
        a1.plot([t for t, _ in pts], [v for _, v in pts], "s", label=f"validation {key.split('/', 1)[1]}")
    a1.set_ylabel("reward")
    a1.legend(fontsize=8)
    _line(a2, s, "response_length/mean", "mean")
    _line(a2, s, "response_length/max", "max", linestyle=":")
    a2.set_ylabel("response length (tokens)")
    a2.set_xlabel("step")
    a2.legend(fontsize=8)
    fig.suptitle("reward and response length per step")
    return fig


def phase_seconds(s: Series) -> dict[str, dict[int, float]]:
    """Seconds per phase of every training step; generation is split into the reshard and the rest
    (verl's ``timing_s/gen`` holds the sharding manager's reshard), the rest of ``timing_s/step`` last."""
    steps = _train_steps(s)
    t = {k: s.get(f"timing_s/{k}") for k in ("gen", "reshard", "reward", "old_log_prob", "ref", "adv",
                                               "update_actor", "testing", "save_checkpoint", "step")}
    out: dict[str, dict[int, float]] = {}
    names = (("generation", lambda i: t["gen"].get(i, 0.0) - t["reshard"].get(i, 0.0)),
             ("reshard", lambda i: t["reshard"].get(i, 0.0)), ("reward", lambda i: t["reward"].get(i, 0.0)),
             ("old log-prob", lambda i: t["old_log_prob"].get(i, 0.0)), ("reference", lambda i: t["ref"].get(i, 0.0)),
             ("advantage", lambda i: t["adv"].get(i, 0.0)), ("update", lambda i: t["update_actor"].get(i, 0.0)),
             ("validation", lambda i: t["testing"].get(i, 0.0)),
             ("checkpoint", lambda i: t["save_checkpoint"].get(i, 0.0)))
    fn: Callable[[int], float]
    for name, fn in names:
        vals = {i: max(0.0, fn(i)) for i in steps}
        if any(vals.values()):
            out[name] = vals
    if t["step"]:
        out[_REST] = {i: max(0.0, t["step"].get(i, 0.0) - sum(v.get(i, 0.0) for v in out.values())) for i in steps}
    return out


def fig_phases(s: Series, plt: Any) -> Any:
    phases = phase_seconds(s)
    if not phases:
        return None
    steps = _train_steps(s)
    fig, ax = plt.subplots(figsize=(8, 5))
    bottom = [0.0] * len(steps)
    for name, vals in phases.items():
        h = [vals.get(i, 0.0) for i in steps]
        ax.bar(steps, h, bottom=bottom, label=name)
        bottom = [b + x for b, x in zip(bottom, h)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8, ncol=2)
    ax.set_title("seconds per phase of each step (stacked)")
    return fig


def fig_switch(s: Series, plt: Any) -> Any:
    moved = [k for k in ("switch/reshard_sent_bytes", "switch/reshard_recv_bytes", "switch/link_bytes") if s.get(k)]
    peaks = [k for k in ("switch/ledger_peak_bytes", "switch/device_allocated_peak_bytes",
                         "switch/device_reserved_peak_bytes") if s.get(k)]
    per_step = [k for k in s.keys("switch/mem/") if k.endswith("/allocated_peak_bytes")]
    if not moved and not peaks:
        return None
    rows = 2 + bool(per_step)
    fig, axes = plt.subplots(rows, 1, figsize=(8, 3 * rows), sharex=True)
    unit, scale = _bytes_unit(s, moved)
    for k in moved:
        _line(axes[0], s, k, k.removeprefix("switch/").removesuffix("_bytes"), scale=scale)
    axes[0].set_ylabel(f"{unit} per rank")
    axes[0].set_title("bytes moved since the previous switch (mean over ranks)")
    if moved:
        axes[0].legend(fontsize=8)
    unit, scale = _bytes_unit(s, peaks)
    for k in peaks:
        _line(axes[1], s, k, k.removeprefix("switch/").removesuffix("_bytes"), scale=scale)
    axes[1].set_ylabel(unit)
    device = any(k.startswith("switch/device_") for k in peaks)
    axes[1].set_title("peaks: offload ledger" + (", device watermarks (max over ranks)" if device
                                                  else " (no device watermarks on this platform)"))
    if peaks:
        axes[1].legend(fontsize=8)
    if per_step:
        unit, scale = _bytes_unit(s, per_step)
        for k in per_step:
            _line(axes[2], s, k, k.removeprefix("switch/mem/").removesuffix("/allocated_peak_bytes"), scale=scale)
        axes[2].set_ylabel(f"{unit} allocated")
        axes[2].set_title("device watermark per switch step")
        axes[2].legend(fontsize=7, ncol=3)
    axes[-1].set_xlabel("step")
    return fig


def mismatch_keys(s: Series) -> list[tuple[str, list[str]]]:
    out = []
    for title, prefixes in MISMATCH_FAMILIES:
        keys = sorted({k for p in prefixes for k in s.keys(p) if any(t > 0 for t in s.get(k))})
        if keys:
            out.append((title, keys))
    return out


def fig_mismatch(s: Series, plt: Any) -> Any:
    fams = mismatch_keys(s)
    if not fams:
        return None
    fig, axes = plt.subplots(len(fams), 1, figsize=(8, 2.6 * len(fams)), sharex=True, squeeze=False)
    for ax, (title, keys) in zip(axes[:, 0], fams):
        for k in keys:
            _line(ax, s, k, k.split("/", 1)[1])
        ax.set_title(title)
        ax.legend(fontsize=7, ncol=2)
    axes[-1, 0].set_xlabel("step")
    return fig


def fig_throughput(s: Series, plt: Any) -> Any:
    if not s.get("perf/tps_per_card") and not s.get("perf/throughput"):
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    _line(ax, s, "perf/tps_per_card", "perf/tps_per_card (tokens/s per card)")
    _line(ax, s, "perf/throughput", "perf/throughput (verl: tokens/s per device)", linestyle=":")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s")
    ax.set_title("throughput: (prompt + response tokens) / step time")
    ax.legend(fontsize=8)
    return fig


FIGURES: dict[str, tuple[Callable[[Series, Any], Any], str]] = {
    "reward": (fig_reward, "critic/score/mean, response_length/mean"),
    "phases": (fig_phases, "timing_s/*"),
    "switch": (fig_switch, "switch/* bytes and peaks"),
    "mismatch": (fig_mismatch, "training/rollout_probs_diff_*, training/rollout_logprob_abs_diff_*, "
                               "training/rollout_kl_k3, actor/entropy, switch/fingerprint_*"),
    "throughput": (fig_throughput, "perf/tps_per_card, perf/throughput"),
}


def plot_run(run_dir: Path, out_dir: Path | None = None) -> tuple[Series, dict[str, Path], dict[str, str]]:
    """Write the figures; return the source, the PNGs written and the figures skipped (with why)."""
    series = read_run(run_dir)
    if not _train_steps(series):
        raise PlotError(f"{series.source} has no training step yet (only step 0, the validation before training)")
    try:
        # Lazy: matplotlib and tensorboard are optional and slow to import; only drawing and reading event files need
        # them.
        import matplotlib
    except ImportError:
        raise PlotError("the plots need matplotlib (requirements.txt)") from None
    matplotlib.use("Agg")
    # Lazy: matplotlib and tensorboard are optional and slow to import; only drawing and reading event files need them.
    import matplotlib.pyplot as plt

    out_dir = out_dir or run_dir / PLOTS_DIR
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlotError(f"cannot create {out_dir}: {e.strerror}") from None
    written, skipped = {}, {}
    for name, (make, needs) in FIGURES.items():
        fig = make(series, plt)
        if fig is None:
            skipped[name] = f"none of {needs} in the run"
            continue
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written[name] = path
    return series, written, skipped


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=PathArg("run directory"), help="the run's output directory (metrics.jsonl and/or tensorboard/)")
    p.add_argument("--out", type=PathArg("output directory"), default=None, help=f"where the PNGs go (default RUN_DIR/{PLOTS_DIR})")
    args = p.parse_args(argv)
    try:
        series, written, skipped = plot_run(args.run_dir, args.out)
    except PlotError as e:
        print(f"error: plot: {e}", file=sys.stderr)
        return 2
    steps = _train_steps(series)
    print(f"plots of {len(steps)} step(s) from {series.source}: "
          + ", ".join(str(p) for p in written.values()))
    for name, why in skipped.items():
        print(f"  {name}.png not drawn: {why}")
    return 0
