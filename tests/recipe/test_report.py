"""The run's report (verl_patches/reporting/report.py), its console filter (verl_patches/reporting/console.py) and the
tracker patch that feeds it (verl.tracking.report_init / report) on verl's real Tracking."""

from __future__ import annotations

import io
import json

import pytest

from verl_patches.reporting import console
from verl_patches.reporting.report import (CONSOLE_LINE, Cards, CardsError, MetricsFileError, NonFiniteMetricError, RunReport,
                                 tps_per_card)

STEP = {"critic/score/mean": 0.25, "response_length/mean": 16.0, "actor/pg_loss": 0.0, "timing_s/gen": 0.6,
        "timing_s/reshard": 0.02, "timing_s/step": 3.0, "perf/total_num_tokens": 1912, "perf/time_per_step": 3.0,
        "perf/throughput": 1912 / 3.0 / 4, "timing_s/switch/link_bytes": 4.0e6,
        "timing_s/switch/ledger_peak_bytes": 8.0e6}


@pytest.mark.parametrize("devices,device,platform,setting,per_card", [
    (256, "npu", "npu", None, 2),      # Ascend A3: 2 dies per card
    (128, "cuda", "cuda", None, 1),    # NVIDIA: a GPU is a card
    (4, "cuda", "cpu", None, 1),       # the CPU platform: each worker one device, one card
    (16, "npu", "npu", 4, 4),          # the setting wins
    (256, "npu", "cpu", None, 2),      # Ray hid the NPUs from the driver: trainer.device still says npu
])
def test_cards_of_a_run(devices, device, platform, setting, per_card):
    cards = Cards.of(devices, device, platform, setting)
    assert cards.per_card == per_card and cards.count == devices // per_card
    if platform == "cpu" and device != "npu":
        assert "CPU platform (no accelerator in the driver): each worker counts as one device" in cards.describe()


def test_cards_that_do_not_divide_are_an_error_naming_the_setting():
    with pytest.raises(CardsError, match="recipe.devices_per_card"):
        Cards.of(3, "npu", "npu")
    with pytest.raises(CardsError, match="no card size known"):
        Cards.of(4, "xpu", "xpu")


def test_tps_per_card_is_the_references_definition():
    # The reference's real-weight row (docs/PERFORMANCE.md): 8192 samples of 77.8 + 1576.6 tokens in
    # 859.7 s on 128 A3 cards (256 dies) is 123.2 tokens/s per card.
    data = {"perf/total_num_tokens": 8192 * (77.8 + 1576.6), "perf/time_per_step": 859.7}
    assert round(tps_per_card(data, Cards.of(256, "npu", "npu")), 1) == 123.2
    # On NVIDIA a card is a device: equal to verl's per-device figure.
    verl = data["perf/total_num_tokens"] / (859.7 * 128)
    assert tps_per_card(data, Cards.of(128, "cuda", "cuda")) == pytest.approx(verl)
    assert tps_per_card({"perf/time_per_step": 1.0}, Cards.of(1, "cuda", "cuda")) is None


def test_a_step_gets_its_line_its_record_and_the_summary(tmp_path):
    out = io.StringIO()
    report = RunReport(total_steps=2, metrics_file=tmp_path / "m.jsonl", out=out, cards=Cards.of(4, "cuda", "cpu"),
                       tensorboard_dir=str(tmp_path / "tb"))
    assert report.header().startswith("report: perf/tps_per_card = (prompt + response tokens)")
    logged = report.step(dict(STEP), 1)
    assert logged["perf/tps_per_card"] == pytest.approx(1912 / 3.0 / 4)
    assert "switch/link_bytes" in logged and "timing_s/switch/link_bytes" not in logged
    report.step({**STEP, "critic/score/mean": 0.5, "val-core/x/reward/mean@1": 0.1}, 2)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["perf/tps_per_card"] == pytest.approx(159.33, abs=0.01)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/2 | reward 0.250 | resp_len 16.0") and "tps/card 159.3" in lines[0]
    assert lines[2] == "summary: 2 step(s); reward 0.250 (step 1) -> 0.500 (step 2)"
    assert any(line.startswith("throughput: 159.3 tokens/s per card") for line in lines)
    assert "switch peaks: offload ledger 8.00 MB" in lines
    # Every line the report prints is one the console filter keeps.
    assert all(CONSOLE_LINE.match(line) for line in [report.header(), *lines])


def test_the_generations_rebalance_figures_are_moved_out_of_timing():
    # The rollout's rebalance figures come through the switch's channel (verl_patches/rollout/long_tail/migrate.py).
    moved = RunReport(total_steps=1, out=io.StringIO()).step({**STEP, "timing_s/rollout/rebalance_moves": 8.0}, 1)
    assert moved["rollout/rebalance_moves"] == 8.0 and "timing_s/rollout/rebalance_moves" not in moved


def test_device_watermarks_are_shown_and_per_step_ones_stay_out_of_the_line():
    out = io.StringIO()
    report = RunReport(total_steps=1, out=out)
    report.step({**STEP, "timing_s/switch/device_allocated_peak_bytes": 3 * 2**30,
                 "timing_s/switch/device_reserved_peak_bytes": 4 * 2**30,
                 "timing_s/switch/mem/reshard/allocated_peak_bytes": 2 * 2**30}, 1)
    line = out.getvalue().splitlines()[0]
    assert "device peak 3.00 GiB allocated, 4.00 GiB reserved" in line and "mem/" not in line


def test_an_unwritable_metrics_file_is_refused_when_the_report_is_built(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(MetricsFileError, match="recipe.metrics_file=.*cannot write it"):
        RunReport(total_steps=1, metrics_file=tmp_path / "file" / "m.jsonl")


def test_a_nan_stops_the_run_naming_the_metric():
    report = RunReport(total_steps=1, out=io.StringIO())
    with pytest.raises(NonFiniteMetricError, match="actor/pg_loss"):
        report.step({**STEP, "actor/pg_loss": float("nan")}, 1)


def test_the_console_filter_keeps_the_report_and_logs_everything(tmp_path):
    noise = [
        "\x1b[36m(TaskRunner pid=7869)\x1b[0m WARNING:2026-11-25 12:11:42,433:some warning",
        "(WorkerDict pid=8000) TF config: MLATransformerConfig(tensor_model_parallel_size=2, ...)",
        "(TaskRunner pid=7869) step:3 - actor/kl_loss:0.057 - actor/pg_loss:0.000",
        "(TaskRunner pid=7869) validation generation end",
        "Traceback (most recent call last):",
    ]
    kept = ["\x1b[36m(TaskRunner pid=7869)\x1b[0m step 3/3 | reward 0.234 | resp_len 16.0",
            "(TaskRunner pid=7869, ip=10.0.0.2) summary: 3 step(s); reward 0.094 (step 1) -> 0.234 (step 3)",
            "(TaskRunner pid=7869) report: perf/tps_per_card = ..."]
    src = io.BytesIO("\n".join(noise + kept).encode() + b"\n\xff broken utf-8\n")
    log, out = io.BytesIO(), io.StringIO()
    assert console.relay(src, log, out) == 3
    assert out.getvalue().splitlines() == ["step 3/3 | reward 0.234 | resp_len 16.0",
                                           "summary: 3 step(s); reward 0.094 (step 1) -> 0.234 (step 3)",
                                           "report: perf/tps_per_card = ..."]
    assert log.getvalue() == src.getvalue()


def test_the_tracker_patch_builds_the_report_and_writes_tensorboard(tmp_path, monkeypatch, capsys):
    """verl's real Tracking with the console and tensorboard backends, the patch applied: the report's
    line replaces verl's dump, tps_per_card reaches tensorboard, and the events are on disk at once."""
    from omegaconf import OmegaConf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from verl_patches.core import apply as ap
    from verl_patches.patches.verl import patch_utils_tracking as P

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    cfg = OmegaConf.create({
        "trainer": {"total_training_steps": 2, "nnodes": 1, "n_gpus_per_node": 4, "device": "cuda"},
        "actor_rollout_ref": {"actor": {"recompute_old_log_prob": True}, "rollout": {"recipe": {
            "metrics_file": str(tmp_path / "metrics.jsonl"), "tensorboard_dir": str(tmp_path / "tb")}}}})
    ids = ap.apply_all(P.PATCHES)
    try:
        from verl.utils.tracking import Tracking

        tracker = Tracking("p", "e", default_backend=["console", "tensorboard"], config=cfg)
        tracker.log(dict(STEP), 1)
        tracker.log({**STEP, "critic/score/mean": 0.5}, 2)
        acc = EventAccumulator(str(tmp_path / "tb"))
        acc.Reload()  # without closing the writer: the patch flushed it
        assert [e.step for e in acc.Scalars("perf/tps_per_card")] == [1, 2]
        assert [e.value for e in acc.Scalars("critic/score/mean")] == [0.25, 0.5]
        assert "switch/link_bytes" in acc.Tags()["scalars"]
    finally:
        ap.undo([p.id for p in P.PATCHES])
    printed = capsys.readouterr().out
    assert "step 1/2 | reward 0.250" in printed and "step:1 - " not in printed  # verl's dump left out
    header = [line for line in printed.splitlines() if line.startswith("report: ")]
    assert len(header) == 1 and header[0].endswith(f"tensorboard {tmp_path / 'tb'}")


def test_the_console_filter_names_a_log_it_cannot_write(tmp_path):
    import subprocess
    import sys

    (tmp_path / "file").write_text("x")
    r = subprocess.run([sys.executable, "-m", "verl_patches.reporting.console", str(tmp_path / "file" / "trainer.log")],
                       input=b"step 1/1 | reward 0.1\n", capture_output=True, timeout=300)
    assert r.returncode == 2 and b"error: cannot write the log" in r.stderr and b"Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "verl_patches.reporting.console", str(tmp_path / "logs" / "trainer.log")],
                       input=b"noise\n(TaskRunner pid=1) step 1/1 | reward 0.1\n", capture_output=True, timeout=300)
    assert r.returncode == 0 and r.stdout == b"step 1/1 | reward 0.1\n"
    assert (tmp_path / "logs" / "trainer.log").read_bytes() == b"noise\n(TaskRunner pid=1) step 1/1 | reward 0.1\n"
