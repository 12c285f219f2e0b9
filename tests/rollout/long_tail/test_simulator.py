"""The rollout simulator (python -m verl_patches rollout-plan, verl_patches/rollout/long_tail/simulator.py): the
reference's published long-tail figures reproduced in direction and rough size from stated inputs, the
tiny run's own recorded lengths, the length sources, the model's invariants (hypothesis), and the CLI's
named errors. Fast: each model run here takes well under a second on one core."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hypothesis import given, settings as hsettings, strategies as st

from tests.helpers import REPO
from verl_patches.cli import main as cli_main
from verl_patches.rollout.long_tail import simulator as P
from verl_patches.rollout.long_tail import rebalance as rb

TINY_METRICS = REPO / "tests" / "fixtures" / "rollout" / "tiny_run_metrics.jsonl"
LADDER = (1, 2, 4, 8, 16, 32, 64)


def run_cli(capsys, *argv):
    try:
        rc = cli_main(["rollout-plan", *argv])
    except SystemExit as e:  # a value an option's declaration refuses: argparse's usage error
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_reference_long_tail_is_reproduced_in_direction_and_size():
    """The reference (DeepSeek-V3, TP2 DP128, 512 prompts x 16, responses up to 32K, on 128 A3 cards)
    reports one rollout of about 6,200 s by default and about 2,300 s with graphs of several sizes and
    request rebalance (2.7x), TPOT climbing 125 -> 200 ms in the default's tail and staying near 60 ms
    with both. Assumed inputs (docs/ROLLOUT.md): the preset TPOT table (graph size 64 climbs 125 -> 200 ms
    with the context, the small graph sizes 51-69 ms), lognormal lengths with median 3,000 and sigma 0.9
    capped at 32,768 (0.4% reach the cap), prompts of 512 tokens."""
    table = P.reference_a3_table()
    lengths = P.parse_lengths_spec("lognormal:median=3000,sigma=0.9").sample(np.random.default_rng(0), 8192, 32768)
    base = P.Scenario(128, 64, (64,), rb.RebalancePolicy(), 512, table)
    default = P.simulate(base, lengths)
    graph_sizes_only = P.simulate(P.replace(base, graph_sizes=LADDER), lengths)
    both = P.simulate(P.replace(base, graph_sizes=LADDER, policy=rb.RebalancePolicy(True)), lengths)
    # Every response runs to its end: the longest decides the steps in all three.
    assert default.steps == both.steps == int(lengths.max()) == 32768
    # The default: one graph size all along, TPOT 125 -> 200 ms, most of the time in the tail.
    assert default.graph_size_s.keys() == {64}
    assert default.segments[0][4] == pytest.approx(125 * 1.016, rel=0.01)  # context = the 512-token prompt
    assert default.segments[-1][4] == pytest.approx(200, rel=0.01)
    assert 4500 < default.total_s < 7000  # the reference: about 6,200 s
    assert default.tail_share > 0.6
    # Graph sizes and rebalance: the tail's TPOT stays near 60 ms, the rollout about 2.3 to 2.7x shorter.
    tail = [ms for t0, _, _, _, ms in both.segments if t0 >= both.total_s - both.tail_s]
    assert max(tail) < 75 and min(tail) > 50
    assert 1800 < both.total_s < 2800  # the reference: about 2,300 s
    ratio = default.total_s / both.total_s
    assert 2.0 < ratio < 3.2  # the reference: 6,200 / 2,300 = 2.7
    # Each part helps: more graph sizes alone, and rebalance on top of them.
    assert both.total_s < graph_sizes_only.total_s < default.total_s
    assert both.moves > 0 and both.migrate_s < 0.01 * both.total_s


def test_the_tiny_runs_recorded_lengths_give_no_tail(capsys):
    """The tiny run's metrics.jsonl (its format: verl_patches/reporting/report.py; this file is a tiny run's own
    output, 6 steps on the CPU): every response ran to the 16-token cap (clip ratio 1.0), so the DP
    ranks finish together, there is no tail, and one graph with no rebalance is the recommendation."""
    rc, out, err = run_cli(capsys, "--lengths", str(TINY_METRICS), "--dp", "2", "--prompts", "8", "--n", "4",
                           "--tpot", "1=50,2=52,4=55,8=60,16=70", "--no-png", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    rec = [json.loads(x) for x in TINY_METRICS.read_text().splitlines()][-1]
    assert doc["fit"]["mean"] == rec["response_length/mean"] == 16
    assert doc["fit"]["clip_ratio"] == rec["response_length/clip_ratio"] == 1.0
    inputs = doc["inputs"]
    assert (inputs["max_len"], inputs["length_mean"], inputs["length_max"], inputs["length_clip_ratio"]) == (16, 16, 16, 1)
    assert inputs["prompt_len"] == round(rec["prompt_length/mean"]) and inputs["max_num_seqs"] == 16
    given = doc["given"]
    assert given["steps"] == 16 and given["tail_s"] == 0 and given["moves"] == 0
    assert given["decode_s"] == pytest.approx(16 * 0.070)
    r = doc["recommendation"]
    assert (r["graph_batch_sizes"], r["max_num_seqs"], r["rebalance"]) == ([16], 16, False)
    assert "keep one graph" in r["note"]


def test_a_metrics_record_with_clipped_and_unclipped_responses_is_fitted():
    rec = {"step": 3, "response_length/mean": 900.0, "response_length/min": 50.0,
           "response_length/max": 4096.0, "response_length/clip_ratio": 0.05}
    fit = P.fit_metrics(rec, "record")
    sample = P._fitted_sample(fit, np.random.default_rng(1), 4000)
    assert (sample == 4096).mean() == pytest.approx(0.05)
    assert sample.min() >= 50 and sample.max() == 4096
    assert sample.mean() == pytest.approx(900, rel=0.1)
    with pytest.raises(P.PlanError, match="unclipped mean of"):
        P.fit_metrics({**rec, "response_length/clip_ratio": 0.5}, "record")
    with pytest.raises(P.PlanError, match="inconsistent response lengths"):
        P.fit_metrics({**rec, "response_length/min": 1000.0}, "record")


def test_a_recorded_sample_is_resampled(tmp_path, capsys):
    f = tmp_path / "lengths.json"
    f.write_text(json.dumps([10, 10, 10, 200]))
    rc, out, err = run_cli(capsys, "--lengths", str(f), "--dp", "4", "--prompts", "16", "--n", "4", "--max-len", "256",
                           "--tpot", "4=20,8=25,16=30", "--no-png", "--json", "--graph-batch-sizes", "4,8,16",
                           "--rebalance")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["inputs"]["length_max"] == 200 and doc["given"]["steps"] == 200
    assert doc["given"]["rebalances"] >= 1
    jl = tmp_path / "lengths.jsonl"
    jl.write_text("\n".join(json.dumps({"response_length": x}) for x in (3, 5)))
    txt = tmp_path / "lengths.txt"
    txt.write_text("3\n5\n")
    for src in (jl, txt):
        rc, out, err = run_cli(capsys, "--lengths", str(src), "--dp", "2", "--prompts", "4", "--n", "1",
                               "--tpot", "2=10", "--no-png", "--json", "--no-recommend")
        assert rc == 0 and json.loads(out)["inputs"]["length_max"] == 5, err
    with pytest.raises(P.PlanError, match="exceeds --max-len 100"):
        P.LengthSource("sample", "x", values=(101,)).sample(np.random.default_rng(0), 3, 100)


# ---------- the model's invariants ----------

@st.composite
def small_runs(draw):
    graph_sizes = tuple(sorted(draw(st.sets(st.sampled_from([1, 2, 3, 4, 6, 8]), min_size=1, max_size=4))))
    dp = draw(st.integers(1, 4))
    mns = draw(st.integers(1, graph_sizes[-1]))
    lengths = np.array(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3 * dp * mns)))
    slope = draw(st.sampled_from([0.0, 0.5]))
    table = P.TpotTable({b: ((0, 10.0 + b), (40, 10.0 + b + slope * b * 40)) for b in (1, 2, 3, 4, 6, 8)},
                        prefill_ms_per_token=draw(st.sampled_from([0.0, 0.1])), source="test")
    return P.Scenario(dp, mns, graph_sizes, rb.RebalancePolicy(), draw(st.integers(0, 5)), table), lengths


@hsettings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(run=small_runs())
def test_model_invariants(run):
    sc, lengths = run
    off = P.simulate(sc, lengths)
    on = P.simulate(P.replace(sc, policy=rb.RebalancePolicy(True)), lengths)
    one = P.simulate(P.replace(sc, graph_sizes=(sc.graph_sizes[-1],)), lengths)
    for r in (off, on, one):
        assert r.total_s == pytest.approx(r.decode_s + r.prefill_s + r.migrate_s)
        assert sum(r.graph_size_s.values()) == pytest.approx(r.decode_s)
        assert 0 <= r.tail_s <= r.total_s
    if len(lengths) <= sc.dp * sc.max_num_seqs:  # one wave: the longest response sets the steps
        assert off.steps == on.steps == int(lengths.max())
    # Finer graph sizes never slow the decode; rebalancing to the smallest reachable graph size at every end
    # of a response never does either (the same steps, each in a graph size no larger).
    assert off.decode_s <= one.decode_s + 1e-9
    if len(lengths) <= sc.dp * sc.max_num_seqs:
        assert on.decode_s <= off.decode_s + 1e-9
    assert on.moves >= 0 and off.moves == 0


# ---------- the CLI ----------

def test_the_cli_prints_a_plan_and_draws_the_figure(tmp_path, capsys):
    png = tmp_path / "plan.png"
    rc, out, err = run_cli(capsys, "--dp", "8", "--prompts", "16", "--n", "8", "--max-len", "2048",
                           "--lengths", "0.97*lognormal:median=200,sigma=0.8;0.03*cap",
                           "--tpot", "1=51,2=52,4=55,8=60,16=70", "--png", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for text in ("given:", "tail (after 90% of the responses ended)", "time per group graph size",
                 "recommendation (", "graph_batch_sizes [", "max_num_seqs 16", "figure:"):
        assert text in out
    with pytest.raises(SystemExit) as e:
        cli_main(["rollout-plan", "--help"])
    assert e.value.code == 0 and "rollout-plan" in capsys.readouterr().out


def test_a_tpot_file(tmp_path, capsys):
    f = tmp_path / "tpot.yaml"
    f.write_text("note: measured\nprefill_ms_per_token: 0.1\ntpot_ms:\n  8: {0: 40, 4096: 60}\n  16: 70\n")
    rc, out, err = run_cli(capsys, "--dp", "2", "--prompts", "8", "--n", "4", "--max-len", "512", "--tpot", str(f),
                           "--no-png", "--json", "--no-recommend", "--graph-batch-sizes", "8,16")
    assert rc == 0, err
    assert json.loads(out)["inputs"]["tpot"] == f"--tpot {f}"


@pytest.mark.parametrize("argv,match", [
    (["--tpot", "64=abc"], "--tpot '64=abc': 'abc' is not a number"),
    (["--tpot", "fast"], "expected a preset (reference-a3), a YAML/JSON file"),
    (["--graph-batch-sizes", "12,64"], "no entry for graph batch size(s) [12]"),
    (["--graph-batch-sizes", "16,32", "--max-num-seqs", "64"], "--max-num-seqs 64 exceeds the largest graph batch size 32"),
    (["--graph-batch-sizes", "a,b"], "--graph-batch-sizes must be integers"),
    (["--graph-batch-sizes", "64,64"], "strictly increasing"),
    (["--lengths", "gamma:k=1"], "unknown distribution 'gamma'"),
    (["--lengths", "lognormal:median=100"], "lognormal needs median, sigma"),
    (["--lengths", "lognormal:median=100,sigma=0.5,mu=3"], "lognormal takes median, sigma, got 'mu=3'"),
    (["--lengths", "nofile.jsonl"], "--lengths nofile.jsonl: cannot read it"),
    (["--dp", "0"], "argument --dp: '0': expected a whole number >= 1"),
    (["--prompts", "2000", "--n", "1000"], "at most 1000000"),
    (["--tail-fraction", "2"], "argument --tail-fraction: '2': expected a finite number >= 0 and <= 1"),
    (["--max-imbalance", "0.5", "--rebalance"], "argument --max-imbalance: '0.5': expected a finite number >= 1"),
    (["--metrics-step", "1"], "--metrics-step needs --lengths to be a run's metrics.jsonl"),
])
def test_bad_input_is_a_named_error(argv, match, capsys):
    rc, _, err = run_cli(capsys, "--no-png", "--no-recommend", "--dp", "4", "--prompts", "4", "--n", "4", *argv)
    assert rc == 2 and match in err and "Traceback" not in err, err


def test_bad_files_are_named(tmp_path, capsys):
    bad = tmp_path / "m.jsonl"
    shutil.copy(TINY_METRICS, bad)
    for text, match in [("", "the file is empty"), ("{\n", "line 1 is not JSON"),
                        ('{"step": 1}\n', "no line has response lengths"),
                        ('{"response_length": 0}\n', "response_length must be an integer >= 1"),
                        ('{"step": 1, "response_length/mean": 5, "response_length/min": 6, "response_length/max": 9,'
                         ' "response_length/clip_ratio": 0}\n', "inconsistent response lengths")]:
        bad.write_text(text)
        rc, _, err = run_cli(capsys, "--lengths", str(bad), "--no-png", "--tpot", "16=1")
        assert rc == 2 and match in err, (text, err)
    rc, _, err = run_cli(capsys, "--lengths", str(TINY_METRICS), "--metrics-step", "9", "--no-png", "--tpot", "16=1")
    assert rc == 2 and "has response lengths for steps [1, 2, 3, 4, 5, 6]" in err
    rc, _, err = run_cli(capsys, "--lengths", str(TINY_METRICS), "--max-len", "32", "--no-png", "--tpot", "16=1")
    assert rc == 2 and "responses were cut at 16 tokens" in err
    t = tmp_path / "t.yaml"
    for text, match in [("tpot_ms: {}", "non-empty mapping"), ("x: 1", "a mapping with a 'tpot_ms'"),
                        ("tpot_ms: {64: .nan}", "tpot_ms[64] must be a finite number > 0"),
                        ("tpot_ms: {64: 1}\nextra: 2", "unknown key(s) ['extra']"), ("tpot_ms: [1, 2", "not YAML/JSON")]:
        t.write_text(text)
        rc, _, err = run_cli(capsys, "--tpot", str(t), "--no-png", "--no-recommend")
        assert rc == 2 and match in err, (text, err)
