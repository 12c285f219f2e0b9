"""The seed systems' data sets (issue 47 item 3): MATH-lighteval (Pai-Megatron-Patch's recipe) and dapo-math-17k
(slime's DeepSeek-R1 recipe) end to end: the shipped samples through `prepare` to verl's parquet, read back, scored
by the recipe's reward through verl's default scorer and validated by `check`; their bad rows named, counted and
nothing half-written; the hub's parquet layout read like the text one; `--download` naming its source and failing
clearly with no network."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_patches.checks import data_check as C
from verl_patches.data import prepare as P

SEED_KINDS = ("math_lighteval", "dapo_math")


@pytest.fixture(scope="module")
def scorer():
    return C.recipe_scorer()[0]


def _rows(d, split="train"):
    return pq.read_table(str(d / f"{split}.parquet")).to_pylist()


def _sample_lines(kind):
    return [json.loads(line) for line in P.SAMPLES[kind].read_text().splitlines()]


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _as_parquet(kind, path):
    pq.write_table(pa.Table.from_pylist(_sample_lines(kind)), str(path))
    return path


def test_math_lighteval_reference_solutions_score_1_and_wrong_answers_0(tmp_path, scorer):
    """Every sample solution, given whole as the response, is scored 1.0 against the ground truth prepare took
    from it (its last box); a wrong box 0.0. level and type travel in extra_info; check passes the files."""
    P.prepare("math_lighteval", None, tmp_path, test_size=0.2, seed=3)
    rows = _rows(tmp_path) + _rows(tmp_path, "test")
    raw = _sample_lines("math_lighteval")
    assert len(rows) == len(raw) == 30
    for r in rows:
        src, extra = raw[r["extra_info"]["source_row"] - 1], r["extra_info"]
        assert r["data_source"] == "deepscaler" and extra["dataset"] == "math_lighteval"
        assert (extra["level"], extra["type"], extra["solution"]) == (src["level"], src["type"], src["solution"])
        assert r["prompt"] == [{"role": "user", "content": f"{src['problem']} {P.INSTRUCTION}"}]
        gt = r["reward_model"]["ground_truth"]
        assert scorer(r["data_source"], src["solution"], gt, extra) == 1.0, gt
        assert scorer(r["data_source"], "So the answer is \\boxed{-123456.5}.", gt, extra) == 0.0, gt
    assert C.check_files([tmp_path / "train.parquet", tmp_path / "test.parquet"], scorer) == []


def test_dapo_prompts_ask_for_the_box_the_reward_reads(tmp_path, scorer):
    """DAPO's wrapper asks for a last line "Answer: ..."; the recipe's reward reads only the last \\boxed{} and
    scores that line 0, so prepare writes the bare problem with the recipe's instruction, from string and chat
    prompts alike, and a boxed answer scores 1.0."""
    P.prepare("dapo_math", None, tmp_path, test_size=0)
    rows, raw = _rows(tmp_path), _sample_lines("dapo_math")
    assert len(rows) == len(raw) == 24 and {type(r["prompt"]) for r in raw} == {str, list}
    for r in rows:
        src = raw[r["extra_info"]["source_row"] - 1]
        text = src["prompt"] if isinstance(src["prompt"], str) else src["prompt"][0]["content"]
        problem = text[len(P.DAPO_PREFIX):-len(P.DAPO_SUFFIX)]
        assert r["prompt"] == [{"role": "user", "content": f"{problem} {P.INSTRUCTION}"}]
        gt = r["reward_model"]["ground_truth"]
        assert gt == src["label"] and r["extra_info"]["dataset"] == "dapo_math"
        assert scorer(r["data_source"], f"Thinking...\nAnswer: {gt}", gt, r["extra_info"]) == 0.0
        assert scorer(r["data_source"], f"Thinking... so \\boxed{{{gt}}}.", gt, r["extra_info"]) == 1.0
        assert scorer(r["data_source"], f"Thinking... so \\boxed{{{int(gt) + 1}}}.", gt, r["extra_info"]) == 0.0
    assert C.check_files([tmp_path / "train.parquet"], scorer) == []


def test_dapo_chat_prompt_keeps_its_system_message(tmp_path):
    f = _jsonl(tmp_path / "chat.jsonl", [
        {"prompt": [{"role": "system", "content": "You are a careful mathematician."},
                    {"role": "user", "content": P.DAPO_PREFIX + "What is $6 \\cdot 7$?" + P.DAPO_SUFFIX}],
         "label": 42},
        {"prompt": "What is $2^5$?", "label": "32"},
    ])
    P.prepare("dapo_math", f, tmp_path / "o", test_size=0)
    first, second = _rows(tmp_path / "o")
    assert first["prompt"] == [{"role": "system", "content": "You are a careful mathematician."},
                               {"role": "user", "content": f"What is $6 \\cdot 7$? {P.INSTRUCTION}"}]
    assert first["reward_model"]["ground_truth"] == "42"
    assert second["prompt"] == [{"role": "user", "content": f"What is $2^5$? {P.INSTRUCTION}"}]


BAD = {
    "math_lighteval": (
        {"problem": "What is $1+1$?", "level": "Level 1", "type": "Algebra", "solution": "It is $\\boxed{2}$."},
        [
            ({"problem": "p", "level": "Level 1", "type": "Algebra"}, "missing field 'solution'"),
            ({"problem": "p", "level": "Level 2", "type": "Algebra", "solution": "The answer is 4."},
             "field 'solution' has no \\boxed{} final answer"),
            ({"problem": "p", "type": "Algebra", "solution": "$\\boxed{3}$"}, "missing field 'level'"),
            ({"problem": "p", "level": "Level 1", "type": "Algebra", "solution": "so $\\boxed{}$"},
             "has no \\boxed{} final answer"),
            ({"problem": "p", "level": "Level 1", "type": "Algebra", "solution": "so $\\boxed{N/A}$"},
             "ground truth 'N/A' is a placeholder"),
            (["not", "an", "object"], "expected an object, got list"),
            ('{"problem": "cut', "not valid JSON"),
        ],
    ),
    "dapo_math": (
        {"prompt": [{"role": "user", "content": "What is $3 \\cdot 3$?"}], "label": "9"},
        [
            ({"prompt": "What is $1+1$?"}, "missing field 'label'"),
            ({"prompt": [], "label": "1"}, "field 'prompt' must be a string or a non-empty list of {role, content} "
                                           "messages, got an empty list"),
            ({"prompt": [{"role": "user"}], "label": "1"}, "missing field 'prompt[0].content'"),
            ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "label": "1"},
             "the last message is from 'assistant', not the user"),
            ({"prompt": "What is $5-2$? Put it after \"Answer:\" on the last line.", "label": "3"},
             "field 'prompt' asks for the answer on a last line 'Answer: ...'"),
            ({"prompt": "q", "label": "unknown"}, "ground truth 'unknown' is a placeholder"),
            ({"prompt": 7, "label": "1"}, "field 'prompt' must be a string or a non-empty list"),
        ],
    ),
}


@pytest.mark.parametrize("kind", SEED_KINDS)
def test_bad_rows_are_named_counted_and_nothing_is_written(tmp_path, capsys, kind):
    good, bad = BAD[kind]
    f = _jsonl(tmp_path / "bad.jsonl", [good, *(row for row, _ in bad), good])
    out = tmp_path / "out"
    with pytest.raises(P.MalformedDataError) as ei:
        P.prepare(kind, f, out, test_size=0)
    msg = str(ei.value)
    assert f"{len(bad)} malformed row(s)" in msg
    for n, (_, needle) in enumerate(bad, start=2):
        assert f"{f}: line {n}: " in msg and needle in msg, (n, needle, msg)
    assert not out.exists()
    assert P.main([kind, "--input", str(f), "--out-dir", str(out), "--test-size", "0", "--skip-invalid"]) == 0
    stdout, err = capsys.readouterr()
    assert f"train 2, test 0, skipped {len(bad)}" in stdout and err.count("skipped:") == len(bad)
    assert [r["extra_info"]["source_row"] for r in _rows(out)] == [1, len(bad) + 2]


def test_a_parquet_input_gives_the_same_files_as_the_text_one(tmp_path):
    """The hub publishes MATH-lighteval as parquet: the same rows give the same bytes, whichever file holds them.
    (dapo-math-17k's parquet is the original's layout, below.)"""
    P.prepare("math_lighteval", None, tmp_path / "text", test_size=4, seed=5)
    P.prepare("math_lighteval", _as_parquet("math_lighteval", tmp_path / "in.parquet"), tmp_path / "pq",
              test_size=4, seed=5)
    for name in P.OUTPUTS:
        assert (tmp_path / "text" / name).read_bytes() == (tmp_path / "pq" / name).read_bytes()


def test_the_original_dapo_layout_reads_like_slimes_copy(tmp_path):
    """BytedTsinghua-SIA/DAPO-Math-17k: verl's layout, the answer in reward_model.ground_truth."""
    rows = [{"data_source": "math_dapo", "prompt": [{"content": r["prompt"] if isinstance(r["prompt"], str)
                                                     else r["prompt"][0]["content"], "role": "user"}],
             "ability": "MATH", "reward_model": {"ground_truth": r["label"], "style": "rule-lighteval/MATH_v2"}}
            for r in _sample_lines("dapo_math")]
    f = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(f))
    P.prepare("dapo_math", f, tmp_path / "orig", test_size=0)
    P.prepare("dapo_math", None, tmp_path / "slime", test_size=0)
    assert (tmp_path / "orig" / "train.parquet").read_bytes() == (tmp_path / "slime" / "train.parquet").read_bytes()


def test_a_damaged_parquet_input_is_named(tmp_path, capsys):
    f = _as_parquet("math_lighteval", tmp_path / "in.parquet")
    f.write_bytes(f.read_bytes()[:200])
    assert P.main(["math_lighteval", "--input", str(f), "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{f}: not a readable parquet file" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_check_names_a_boxed_source_row_whose_prompt_asks_for_an_answer_line(tmp_path, scorer):
    """A DAPO copy not made by prepare, relabelled to the recipe's source: every right answer would score 0."""
    raw = _sample_lines("dapo_math")[0]["prompt"][0]["content"]
    rows = [{"data_source": "deepscaler", "prompt": [{"role": "user", "content": c}],
             "reward_model": {"ground_truth": "66", "style": "rule"}, "extra_info": {"index": i}}
            for i, c in enumerate([f"Find it. {P.INSTRUCTION}", raw])]
    f = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(f))
    problems = C.check_files([f], scorer)
    assert len(problems) == 1 and problems[0].startswith(f"{f}: row 2: column prompt[0]: asks for the answer on a "
                                                         "last line 'Answer: ...'"), problems


def test_download_names_its_source_and_fails_clearly_offline(tmp_path, capsys, monkeypatch):
    """The real huggingface_hub download, with its offline mode on (as with no network, without the wait for its
    retries) and an empty cache: an error naming the hub file and --input, and nothing written."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    for kind in SEED_KINDS:
        hub = P.FORMATS[kind].download
        out = tmp_path / kind
        assert P.main([kind, "--download", "--out-dir", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"could not fetch {hub.filename} of the Hugging Face hub data set {hub.repo_id}" in err, err
        assert "--input FILE" in err and "nothing was written" in err and "Traceback" not in err
        assert not out.exists()


def test_download_fetches_the_named_file_and_prepares_it(tmp_path, monkeypatch):
    import huggingface_hub

    asked = []

    def fake_download(repo_id, filename, repo_type=None):
        asked.append((repo_id, filename, repo_type))
        got = tmp_path / "cache" / filename
        got.parent.mkdir(parents=True, exist_ok=True)
        if got.suffix == ".parquet":
            return str(_as_parquet("math_lighteval", got))
        got.write_bytes(P.SAMPLES["dapo_math"].read_bytes())
        return str(got)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    for kind in SEED_KINDS:
        summary = P.prepare(kind, None, tmp_path / kind, fetch=True)
        hub = P.FORMATS[kind].download
        assert asked[-1] == (hub.repo_id, hub.filename, "dataset")
        assert summary["input"] == str(tmp_path / "cache" / hub.filename)
        assert summary["train"] + summary["test"] == len(_sample_lines(kind))
    assert asked == [("DigitalLearningGmbH/MATH-lighteval", "data/train-00000-of-00001.parquet", "dataset"),
                     ("zhuzilin/dapo-math-17k", "dapo-math-17k.jsonl", "dataset")]


@pytest.mark.parametrize("argv, needle", [
    (["dapo_math", "--download", "--input", "x.jsonl"], "--download and --input x.jsonl both name the input"),
    (["deepscaler", "--download"], "--download: no published file is known for 'deepscaler'"),
])
def test_download_refusals(tmp_path, capsys, argv, needle):
    assert P.main([*argv, "--out-dir", str(tmp_path / "o")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
