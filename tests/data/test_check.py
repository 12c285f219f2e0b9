"""The data check reads every row of every file with the recipe's columns and types (not a
sample of rows, not two columns), names file, row and column, and holds one record batch at a
time whatever the file's size."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_patches.checks import data_check as C
from verl_patches.data import prepare as P


@pytest.fixture(scope="module")
def scorer():
    return C.recipe_scorer()[0]


def _row(i: int, **over) -> dict:
    r = {"data_source": "deepscaler", "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
         "extra_info": {"index": i}}
    r.update(over)
    return r


def _write(path, rows, schema=None):
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), str(path), row_group_size=7)
    return path


def test_prepared_data_passes(tmp_path, scorer):
    P.prepare("gsm8k", None, tmp_path, test_size=0.25)
    assert C.check_files([tmp_path / "train.parquet", tmp_path / "test.parquet"], scorer) == []
    assert C.main([str(tmp_path / "train.parquet")]) == 0


def test_a_null_ground_truth_in_row_10_is_found(tmp_path, scorer):
    rows = [_row(i) for i in range(40)]
    rows[9] = _row(9, reward_model={"style": "rule", "ground_truth": None})
    problems = C.check_files([_write(tmp_path / "f.parquet", rows)], scorer)
    assert problems == [f"{tmp_path / 'f.parquet'}: row 10: column reward_model.ground_truth: null or empty"]


@pytest.mark.parametrize("bad, needle", [
    ({"prompt": []}, "row 5: column prompt: null or no messages"),
    ({"prompt": [{"role": "user", "content": "   "}]}, "row 5: column prompt: every message's content is empty"),
    ({"prompt": [{"role": None, "content": "x"}]}, "row 5: column prompt[0]: a message without a role"),
    ({"data_source": None}, "row 5: column data_source: null or empty"),
    ({"reward_model": None}, "row 5: column reward_model: null"),
    ({"reward_model": {"style": "rule", "ground_truth": " "}}, "row 5: column reward_model.ground_truth: null or empty"),
    ({"extra_info": None}, "row 5: column extra_info: null"),
])
def test_every_row_is_checked(tmp_path, scorer, bad, needle):
    rows = [_row(i) for i in range(12)]
    rows[4] = _row(4, **bad)
    problems = C.check_files([_write(tmp_path / "f.parquet", rows)], scorer)
    assert len(problems) == 1 and needle in problems[0] and str(tmp_path / "f.parquet") in problems[0], problems


@pytest.mark.parametrize("drop_or_change, needle", [
    ("no-prompt", "no column(s) ['prompt']"),
    ("string-prompt", "column prompt is string, must be a list of {role: string, content: string} messages"),
    ("int-source", "column data_source is int64, must be string"),
    ("gt-list", "must be a struct with a string or number ground_truth"),
    ("extra-string", "column extra_info is string, must be a struct"),
])
def test_columns_and_types(tmp_path, scorer, drop_or_change, needle, capsys):
    rows = [_row(i) for i in range(5)]
    for r in rows:
        if drop_or_change == "no-prompt":
            del r["prompt"]
        elif drop_or_change == "string-prompt":
            r["prompt"] = "What is 1+1?"
        elif drop_or_change == "int-source":
            r["data_source"] = 3
        elif drop_or_change == "gt-list":
            r["reward_model"] = {"ground_truth": ["2"]}
        else:
            r["extra_info"] = "{}"
    f = _write(tmp_path / "f.parquet", rows)
    assert C.main([str(f)]) == 1
    err = capsys.readouterr().err
    assert needle in err and str(f) in err and "Traceback" not in err, err


def test_a_custom_prompt_key_is_the_column_checked(tmp_path, scorer):
    rows = [{**_row(i), "messages": _row(i)["prompt"]} for i in range(3)]
    for r in rows:
        del r["prompt"]
    f = _write(tmp_path / "f.parquet", rows)
    assert C.check_files([f], scorer, prompt_key="messages") == []
    assert "no column(s) ['prompt']" in C.check_files([f], scorer)[0]


def test_row_problems_are_capped_and_counted(tmp_path, scorer):
    rows = [_row(i, data_source=" ") for i in range(50)]
    problems = C.check_files([_write(tmp_path / "f.parquet", rows)], scorer)
    assert len(problems) == C.MAX_ROW_PROBLEMS + 1
    assert problems[-1].endswith(f"and {50 - C.MAX_ROW_PROBLEMS} more row(s) with problems (50 of 50)")


def test_one_record_batch_at_a_time(tmp_path, scorer, monkeypatch):
    """Rows are read in batches of BATCH_ROWS, never the whole file: the largest batch seen is the bound."""
    rows = [_row(i) for i in range(1000)]
    f = _write(tmp_path / "f.parquet", rows)
    seen = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *a, **k):
        for b in real(self, *a, **k):
            seen.append(b.num_rows)
            yield b

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    monkeypatch.setattr(C, "BATCH_ROWS", 64)
    problems: list[str] = []
    got = list(C.scan(f, problems, batch_rows=C.BATCH_ROWS))
    assert problems == [] and len(got) == 1000 and sum(seen) == 1000 and max(seen) <= 64


def test_an_empty_and_a_damaged_file(tmp_path, scorer):
    schema = pa.Table.from_pylist([_row(0)]).schema
    empty = _write(tmp_path / "empty.parquet", [], schema=schema)
    assert C.check_files([empty], scorer) == [f"{empty}: no rows"]
    good = _write(tmp_path / "good.parquet", [_row(i) for i in range(30)])
    data = good.read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: len(data) // 2] + data[-2000:])
    problems = C.check_files([cut], scorer)
    assert problems and str(cut) in problems[0]
