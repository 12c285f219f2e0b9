"""Tests for the data preparation tool: schema, determinism, split, malformed-row errors.

Runs the real pyarrow writer and reads back with pandas; uses the shipped samples.
"""

import json

import pandas as pd
import pytest

from verl_patches.data import prepare as P
from verl_patches.reward.deepscaler import compute_score


def _read(d, split):
    return pd.read_parquet(d / f"{split}.parquet")


@pytest.mark.parametrize("kind", sorted(P.FORMATS))
def test_sample_to_verl_schema(tmp_path, kind):
    summary = P.prepare(kind, None, tmp_path, test_size=0.25, seed=1)
    train, test = _read(tmp_path, "train"), _read(tmp_path, "test")
    n_raw = (len(json.loads(P.SAMPLES[kind].read_text())) if kind == "deepscaler"
             else len(P.SAMPLES[kind].read_text().splitlines()))
    assert n_raw >= 12  # a sample large enough to split and to cover its format's cases
    assert len(train) + len(test) == n_raw == summary["train"] + summary["test"]
    assert len(test) == round(n_raw * 0.25)
    for df, split in ((train, "train"), (test, "test")):
        assert list(df.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        for _, row in df.iterrows():
            assert row["data_source"] == "deepscaler" and row["extra_info"]["dataset"] == kind
            msgs = list(row["prompt"])
            assert len(msgs) == 1 and msgs[0]["role"] == "user"
            assert msgs[0]["content"].endswith(P.INSTRUCTION) and "\\boxed{}" in msgs[0]["content"]
            assert row["reward_model"]["style"] == "rule"
            assert row["extra_info"]["split"] == split
    # train and test are disjoint and together cover every source row
    rows = set(train["extra_info"].map(lambda e: e["source_row"])) | set(test["extra_info"].map(lambda e: e["source_row"]))
    assert len(rows) == n_raw


def test_gsm8k_final_answer_strips_thousands_separator(tmp_path):
    P.prepare("gsm8k", None, tmp_path, test_size=0)
    truths = set(_read(tmp_path, "train")["reward_model"].map(lambda r: r["ground_truth"]))
    assert "2520" in truths and all("," not in t for t in truths)


def test_ground_truths_score_with_the_reward(tmp_path):
    # The parquet answers must be what the rule reward accepts when a model boxes them.
    P.prepare("deepscaler", None, tmp_path, test_size=0)
    for gt in _read(tmp_path, "train")["reward_model"].map(lambda r: r["ground_truth"]):
        assert compute_score("deepscaler", f"so \\boxed{{{gt}}}", gt) == 1.0


def test_deterministic_bytes_and_seed_dependence(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    P.prepare("deepscaler", None, a, test_size=4, seed=7)
    P.prepare("deepscaler", None, b, test_size=4, seed=7)
    P.prepare("deepscaler", None, c, test_size=4, seed=8)
    for split in ("train", "test"):
        assert (a / f"{split}.parquet").read_bytes() == (b / f"{split}.parquet").read_bytes()
    test_rows = lambda d: sorted(_read(d, "test")["extra_info"].map(lambda e: e["source_row"]))  # noqa: E731
    assert test_rows(a) != test_rows(c)


def _bad_deepscaler(tmp_path):
    rows = [
        {"problem": "1+1?", "answer": "2", "solution": "s"},
        {"problem": "no answer"},
        {"problem": "", "answer": "3"},
        ["not", "an", "object"],
        {"problem": "2+2?", "answer": 4},
    ]
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(rows))
    return f


def test_malformed_rows_error_names_every_row(tmp_path):
    with pytest.raises(P.MalformedDataError) as ei:
        P.prepare("deepscaler", _bad_deepscaler(tmp_path), tmp_path / "o", test_size=0)
    msg = str(ei.value)
    assert "3 malformed row(s)" in msg
    assert "item 2: missing field 'answer'" in msg
    assert "item 3: field 'problem' is empty" in msg
    assert "item 4: expected an object, got list" in msg
    assert not (tmp_path / "o").exists()


def test_skip_invalid_reports_count(tmp_path, capsys):
    rc = P.main(["deepscaler", "--input", str(_bad_deepscaler(tmp_path)), "--out-dir", str(tmp_path / "o"),
                 "--test-size", "0", "--skip-invalid"])
    assert rc == 0
    out, err = capsys.readouterr()
    assert "train 2, test 0, skipped 3" in out
    assert err.count("skipped:") == 3
    assert list(_read(tmp_path / "o", "train")["reward_model"].map(lambda r: r["ground_truth"])) == ["2", "4"]


def test_gsm8k_bad_lines_have_line_numbers(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"question": "q", "answer": "x\\n#### 5"}\n\n{not json\n{"question": "q2", "answer": "no marker"}\n')
    with pytest.raises(P.MalformedDataError) as ei:
        P.load_examples("gsm8k", f)
    msg = str(ei.value)
    assert "line 3: not valid JSON" in msg and "line 4: field 'answer' has no '#### <final answer>' line" in msg


def test_cli_errors_are_reported_not_raised(tmp_path, capsys):
    assert P.main(["deepscaler", "--input", str(tmp_path / "missing.json"), "--out-dir", str(tmp_path)]) == 2
    assert "input not found" in capsys.readouterr().err
    f = tmp_path / "obj.json"
    f.write_text('{"problem": "x"}')
    assert P.main(["deepscaler", "--input", str(f), "--out-dir", str(tmp_path)]) == 2
    assert "expected a JSON list" in capsys.readouterr().err


def test_split_rejects_empty_train():
    ex = [P.Example("q", "1", "", 1)]
    with pytest.raises(ValueError, match="leaves no training rows"):
        P.split_examples(ex, 1, 0)


def _snapshot(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_rerun_into_prepared_data_is_refused_unless_overwrite(tmp_path, capsys):
    """Finding 3: re-running into an existing directory overwrote the data without a word."""
    assert P.main(["deepscaler", "--out-dir", str(tmp_path), "--seed", "1"]) == 0
    before = _snapshot(tmp_path)
    assert P.main(["deepscaler", "--out-dir", str(tmp_path), "--seed", "2"]) == 2
    err = capsys.readouterr().err
    assert "already holds train.parquet, test.parquet" in err and "--overwrite" in err
    assert _snapshot(tmp_path) == before
    assert P.main(["deepscaler", "--out-dir", str(tmp_path), "--seed", "2", "--overwrite"]) == 0
    assert _snapshot(tmp_path) != before and sorted(_snapshot(tmp_path)) == ["test.parquet", "train.parquet"]


def test_a_failure_mid_write_leaves_the_previous_pair_intact(tmp_path, monkeypatch):
    """Finding 3: a run killed while writing left a truncated file next to the old one."""
    import errno

    import pyarrow.parquet as pq

    P.prepare("deepscaler", None, tmp_path, seed=1)
    before = _snapshot(tmp_path)
    real = pq.write_table

    def disk_full_on_second_file(table, where, *a, **k):
        if "test" in str(where):
            with open(where, "wb") as f:
                f.write(b"PAR1" + b"\0" * 164)  # what a killed writer leaves: 168 bytes, unreadable
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(table, where, *a, **k)

    monkeypatch.setattr(pq, "write_table", disk_full_on_second_file)
    with pytest.raises(OSError):
        P.prepare("deepscaler", None, tmp_path, seed=2, overwrite=True)
    assert _snapshot(tmp_path) == before  # both old files, byte for byte, and nothing else
