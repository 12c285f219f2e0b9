"""``python -m verl_patches plot RUN_DIR`` on a synthetic run: PNGs from metrics.jsonl alone, from
tensorboard events alone, figures skipped when their metrics are absent, and bad input as a named
error with a non-zero exit (never a traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO
from verl_patches.reporting import plot

PNG = b"\x89PNG\r\n\x1a\n"


def _row(step: int, mismatch: bool = True, device: bool = True) -> dict:
    row = {"step": step, "critic/score/mean": 0.1 * step, "response_length/mean": 16.0, "response_length/max": 16,
           "timing_s/gen": 1.0, "timing_s/reshard": 0.1, "timing_s/ref": 0.5, "timing_s/update_actor": 1.5,
           "timing_s/step": 3.5, "perf/tps_per_card": 100.0 + step, "perf/throughput": 100.0 + step,
           "switch/reshard_sent_bytes": 2.8e5, "switch/reshard_recv_bytes": 2.8e5, "switch/link_bytes": 4e6,
           "switch/ledger_peak_bytes": 8e6}
    if device:  # the device's watermarks (a run on NPU or GPU)
        row.update({"switch/device_allocated_peak_bytes": 40 * 2**30, "switch/device_reserved_peak_bytes": 44 * 2**30,
                    "switch/mem/reshard/allocated_peak_bytes": 30 * 2**30,
                    "switch/mem/reshard/reserved_peak_bytes": 33 * 2**30,
                    "switch/mem/generate/allocated_peak_bytes": 40 * 2**30,
                    "switch/mem/generate/reserved_peak_bytes": 44 * 2**30})
    if mismatch:
        row.update({"training/rollout_probs_diff_max": 0.01 * step, "training/rollout_probs_diff_mean": 0.001,
                    "training/rollout_kl_k3": 1e-4, "actor/entropy": 2.0 - 0.1 * step,
                    "switch/fingerprint_match": 1.0})
    return row


def _run_dir(tmp_path, rows):
    d = tmp_path / "run"
    d.mkdir()
    lines = [json.dumps({"step": 0, "val-core/x/reward/mean@1": 0.0})] + [json.dumps(r) for r in rows]
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return d


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "verl_patches", "plot", *map(str, args)], cwd=str(REPO),
                          capture_output=True, text=True, timeout=120)


def test_plot_writes_every_figure_from_metrics_jsonl(tmp_path):
    run = _run_dir(tmp_path, [_row(s) for s in range(1, 13)])
    series, written, skipped = plot.plot_run(run)
    assert sorted(written) == sorted(plot.FIGURES) and not skipped
    for path in written.values():
        assert path.parent == run / "plots" and path.read_bytes().startswith(PNG)
    assert plot._train_steps(series) == list(range(1, 13))
    phases = plot.phase_seconds(series)
    assert phases["generation"][1] == pytest.approx(0.9) and phases["reshard"][1] == pytest.approx(0.1)
    assert phases["rest of the step"][1] == pytest.approx(3.5 - 1.0 - 0.5 - 1.5)


def test_absent_mismatch_metrics_are_skipped_and_said(tmp_path):
    run = _run_dir(tmp_path, [_row(s, mismatch=False, device=False) for s in (1, 2)])
    r = _cli(run)
    assert r.returncode == 0, r.stderr
    assert "mismatch.png not drawn: none of training/rollout_probs_diff_*" in r.stdout
    assert not (run / "plots" / "mismatch.png").exists() and (run / "plots" / "reward.png").exists()


def test_plot_reads_tensorboard_events_without_metrics_jsonl(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    w = SummaryWriter(str(run / "tensorboard" / "p" / "e"))
    for s in (1, 2, 3):
        for k, v in _row(s).items():
            if k != "step":
                w.add_scalar(k, v, s)
    w.close()
    series, written, _ = plot.plot_run(run)
    assert series.get("critic/score/mean") == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    assert {"reward", "phases", "switch", "mismatch", "throughput"} == set(written)


@pytest.mark.parametrize("make,expected", [
    (lambda d: d / "missing", "does not exist"),
    (lambda d: d, "has no metrics.jsonl and no tensorboard event files"),
    (lambda d: (d / "metrics.jsonl").write_text("{not json\n") and d, "line 1 is not JSON"),
    (lambda d: (d / "metrics.jsonl").write_text('{"x": 1}\n') and d, "line 1 has no integer 'step'"),
    (lambda d: (d / "metrics.jsonl").write_text('{"step": 0, "val-core/a": 1}\n') and d, "has no training step"),
    (lambda d: (d / "f").write_text("a file") and d / "f", "is not a directory"),
])
def test_bad_input_is_a_named_error_with_a_nonzero_exit(tmp_path, make, expected):
    target = make(tmp_path)
    r = _cli(target)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "error: plot: " in r.stderr and expected in r.stderr
    assert "Traceback" not in r.stderr
