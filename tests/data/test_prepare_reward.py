"""Data and reward agree (finding 5): every data source `prepare` writes, for every data set, is
scored right by the reward the recipe configures (verl's real default scorer with the recipe's
reward patch); sources that reward cannot score are refused before anything is written; and
the check the dry run uses names a file whose rows the reward cannot score."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from verl_patches.checks import data_check as C
from verl_patches.data import prepare as P
from verl_patches.patches.verl.patch_utils_reward_score import DEEPSCALER_SOURCES


@pytest.fixture(scope="module")
def scorer():
    return C.recipe_scorer()[0]


@pytest.mark.parametrize("kind", sorted(P.SAMPLES))
@pytest.mark.parametrize("source", [None, *sorted(DEEPSCALER_SOURCES)])
def test_every_row_prepare_writes_is_scored_by_the_recipes_reward(tmp_path, scorer, kind, source):
    P.prepare(kind, None, tmp_path, test_size=0.25, data_source=source)
    for split in ("train", "test"):
        rows = pq.read_table(str(tmp_path / f"{split}.parquet")).to_pylist()
        assert rows
        for r in rows:
            gt = r["reward_model"]["ground_truth"]
            assert r["prompt"][-1]["content"].endswith(P.INSTRUCTION)
            assert scorer(r["data_source"], f"Thinking... so \\boxed{{{gt}}}.", gt, r["extra_info"]) == 1.0
            assert scorer(r["data_source"], "Thinking... so \\boxed{-123456.5}.", gt, r["extra_info"]) == 0.0


@pytest.mark.parametrize("source", ["gsm8k", "openai/gsm8k", "lighteval/MATH"])
def test_a_source_the_reward_cannot_score_is_refused(tmp_path, capsys, source):
    out = tmp_path / "out"
    assert P.main(["gsm8k", "--out-dir", str(out), "--data-source", source]) == 2
    err = capsys.readouterr().err
    assert repr(source) in err and "the recipe's reward scores only" in err
    assert not out.exists()


def test_the_check_names_rows_the_reward_cannot_score(tmp_path, scorer):
    import pyarrow as pa

    rows = [{"data_source": src, "prompt": [{"role": "user", "content": "2*9?"}],
             "reward_model": {"ground_truth": "18", "style": "rule"}}
            for src in ("deepscaler", "gsm8k", "openai/gsm8k")]
    f = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(f))
    problems = C.check_files([f], scorer)
    assert len(problems) == 2
    assert "data_source 'gsm8k' (1 row(s)): the reward has no scorer" in problems[0]
    assert "data_source 'openai/gsm8k'" in problems[1] and "scores 0" in problems[1]
