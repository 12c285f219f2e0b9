"""Turn raw math data sets into verl's RL parquet schema, with a deterministic split.

``python -m verl_patches.data.prepare KIND [--input F | --download] --out-dir D``; no --input uses the shipped
sample (data/sample/). The kinds and what they read (data/README.md has the sources):

- ``deepscaler``: a JSON list of {problem, answer, solution}.
- ``gsm8k``: JSON lines of {question, answer}, the answer ending in ``#### <final answer>``.
- ``math_lighteval``: {problem, solution, level, type} (MATH-lighteval, Pai-Megatron-Patch's recipe); the ground
  truth is the solution's last ``\\boxed{}``.
- ``dapo_math``: {prompt, label} (dapo-math-17k as slime reads it), the prompt a string or chat messages; DAPO's
  "Answer: $Answer" instruction is replaced by the recipe's ``\\boxed{}`` one (the reward reads the last box).

A ``.parquet`` input is read as parquet (the hub's format), any other as the kind's text format. ``--download``
fetches the kind's published file from the Hugging Face hub (math_lighteval, dapo_math). Every row the tool
writes is scored by the recipe's reward (the last ``\\boxed{}``, verl_patches/reward/deepscaler.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from verl_patches.base import atomic
from verl_patches.core.lock import REPO_ROOT
from verl_patches.reward import DEEPSCALER_SOURCES
from verl_patches.base.schema import Integer, Number, PathArg, Text
from verl_patches.reward.deepscaler import _ground_truth_answer, extract_last_boxed, normalize

# The rule reward (verl_patches.reward.deepscaler) reads the last \boxed{}; the prompt must ask for it.
INSTRUCTION = "Let's think step by step and put the final answer within \\boxed{}."
# verl picks the scorer by data_source: every row must name one that the recipe's reward (the
# boxed-answer rule, reached through verl's default scorer) handles, whatever the data set;
# verl's own "openai/gsm8k" scorer reads "#### answer" and would score every boxed answer 0.
RECIPE_REWARD_SOURCES = DEEPSCALER_SOURCES
OUTPUTS = ("train.parquet", "test.parquet")
_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$")
# DAPO-Math-17k wraps each problem in these words; the recipe's reward reads only the last \boxed{}, so a prompt that
# keeps them asks for an answer format that scores 0 (the wrapper is replaced by INSTRUCTION).
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the "
               "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
# A request for DAPO's last line "Answer: ..." in any wording prepare does not strip.
_ANSWER_LINE = re.compile(r"Answer:\s*\$Answer|after\s+\"?Answer:", re.IGNORECASE)


class MalformedDataError(ValueError):
    """Raised with every bad row listed (1-based row numbers) when skipping was not asked for."""


@dataclass(frozen=True)
class Example:
    question: str
    answer: str
    solution: str
    row: int = 0  # 1-based position in the input file, kept for error messages and extra_info
    dataset: str = ""  # the kind it was read as (deepscaler, gsm8k, math_lighteval, dapo_math)
    # (role, content) of the messages before the problem in a chat-formatted input (a system prompt): kept in
    # the prompt, as slime's --apply-chat-template keeps them.
    context: tuple[tuple[str, str], ...] = ()
    # Per-row fields of the data set kept in extra_info (MATH's level and type), in a fixed order.
    meta: tuple[tuple[str, str], ...] = ()


def _require_str(obj: dict, key: str, name: str | None = None) -> str:
    name = name or key
    if key not in obj:
        raise ValueError(f"missing field {name!r}")
    val = obj[key]
    if isinstance(val, (int, float)) and not isinstance(val, bool):
        val = str(val)
    if not isinstance(val, str):
        raise ValueError(f"field {name!r} must be a string, got {type(val).__name__}")
    if not val.strip():
        raise ValueError(f"field {name!r} is empty")
    return val.strip()


def _parse_deepscaler(obj: dict) -> Example:
    solution = obj.get("solution", "")
    if not isinstance(solution, str):
        raise ValueError(f"field 'solution' must be a string, got {type(solution).__name__}")
    return Example(_require_str(obj, "problem"), _require_str(obj, "answer"), solution)


def _parse_gsm8k(obj: dict) -> Example:
    question = _require_str(obj, "question")
    solution = _require_str(obj, "answer")
    m = _GSM8K_FINAL.search(solution)
    if not m:
        raise ValueError("field 'answer' has no '#### <final answer>' line")
    # gsm8k writes thousands separators ("2,520"); the reward compares numbers.
    return Example(question, m.group(1).replace(",", "").strip(), solution)


def _parse_math_lighteval(obj: dict) -> Example:
    problem = _require_str(obj, "problem")
    solution = _require_str(obj, "solution")
    answer = extract_last_boxed(solution)
    if answer is None or not answer.strip():
        raise ValueError("field 'solution' has no \\boxed{} final answer (MATH's ground truth is the solution's "
                         "last \\boxed{})")
    meta = (("level", _require_str(obj, "level")), ("type", _require_str(obj, "type")))
    return Example(problem, answer.strip(), solution, meta=meta)


def answer_format_problem(text: str) -> str | None:
    """Why a prompt's text contradicts the recipe's reward, or None: it asks for DAPO's last line "Answer: ..."
    (the reward reads only the last \\boxed{}, so every correct answer in that format scores 0)."""
    if _ANSWER_LINE.search(text):
        return ("asks for the answer on a last line 'Answer: ...', but the recipe's reward reads only the last "
                "\\boxed{}: every correct answer in that format would score 0")
    return None


def _messages(obj: dict, key: str) -> list[tuple[str, str]]:
    """(role, content) of a prompt given as a string (one user message) or as chat messages."""
    if key not in obj:
        raise ValueError(f"missing field {key!r}")
    val = obj[key]
    if isinstance(val, str):
        return [("user", _require_str(obj, key))]
    if not isinstance(val, list) or not val:
        got = "an empty list" if val == [] else type(val).__name__
        raise ValueError(f"field {key!r} must be a string or a non-empty list of {{role, content}} messages, got {got}")
    out = []
    for i, m in enumerate(val):
        if not isinstance(m, dict):
            raise ValueError(f"field '{key}[{i}]' must be a {{role, content}} message, got {type(m).__name__}")
        out.append((_require_str(m, "role", f"{key}[{i}].role"), _require_str(m, "content", f"{key}[{i}].content")))
    return out


def _parse_dapo_math(obj: dict) -> Example:
    *context, (role, text) = _messages(obj, "prompt")
    if role != "user":
        raise ValueError(f"field 'prompt': the last message is from {role!r}, not the user (it holds the problem)")
    question = text.removeprefix(DAPO_PREFIX).removesuffix(DAPO_SUFFIX).strip()
    for where, content in [*((f"prompt[{i}]", c) for i, (_, c) in enumerate(context)), ("prompt", question)]:
        why = answer_format_problem(content)
        if why:
            raise ValueError(f"field {where!r} {why} (prepare strips only DAPO's own wording)")
    # slime's copy names the answer "label"; the original (BytedTsinghua-SIA/DAPO-Math-17k) has verl's layout.
    rm = obj.get("reward_model")
    if "label" not in obj and isinstance(rm, dict) and "ground_truth" in rm:
        label = _require_str(rm, "ground_truth", "reward_model.ground_truth")
    else:
        label = _require_str(obj, "label")
    return Example(question, label, "", context=tuple(context))


@dataclass(frozen=True)
class HubFile:
    """A file published in a data set repository of the Hugging Face hub."""

    repo_id: str
    filename: str

    def __str__(self) -> str:
        return f"{self.filename} of the Hugging Face hub data set {self.repo_id}"


@dataclass(frozen=True)
class Format:
    sample: Path  # the shipped sample (data/sample/), the default input
    parse: Callable[[dict], Example]
    text: str  # how a non-parquet input is read: "json" (one JSON list) or "jsonl" (an object per line)
    download: HubFile | None = None  # what --download fetches


_SAMPLE_DIR = REPO_ROOT / "data" / "sample"
FORMATS = {
    "deepscaler": Format(_SAMPLE_DIR / "deepscaler_sample.json", _parse_deepscaler, "json"),
    "gsm8k": Format(_SAMPLE_DIR / "gsm8k_sample.jsonl", _parse_gsm8k, "jsonl"),
    # The default config's train split (7,500 problems); the published test split (5,000, MATH500 is drawn from
    # it) is left for evaluation.
    "math_lighteval": Format(_SAMPLE_DIR / "math_lighteval_sample.jsonl", _parse_math_lighteval, "jsonl",
                             HubFile("DigitalLearningGmbH/MATH-lighteval", "data/train-00000-of-00001.parquet")),
    # slime's copy, the file its DeepSeek-R1 recipe passes to --prompt-data.
    "dapo_math": Format(_SAMPLE_DIR / "dapo_math_sample.jsonl", _parse_dapo_math, "jsonl",
                        HubFile("zhuzilin/dapo-math-17k", "dapo-math-17k.jsonl")),
}
SAMPLES = {kind: f.sample for kind, f in FORMATS.items()}
# Every kind is scored by the recipe's reward (slime scores dapo-math-17k with this rule; MATH-lighteval's
# ground truth is its last \boxed{}, the rule's own answer format); extra_info.dataset keeps the kind.
DEFAULT_DATA_SOURCE = {kind: "deepscaler" for kind in FORMATS}


def _parquet_rows(path: Path) -> list[tuple[int, object]]:
    # Lazy: pyarrow loads when a parquet input is read (the recipe's validator imports this module for its rules).
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(str(path)).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a file that is no parquet
        raise MalformedDataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    return list(enumerate(rows, start=1))


def _raw_rows(kind: str, path: Path) -> tuple[str, list[tuple[int, object]]]:
    """What a row is called in messages ("item", "line", "row") and (row number, decoded object or the decode
    error) for every row of the file."""
    if path.suffix == ".parquet":
        return "row", _parquet_rows(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MalformedDataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if FORMATS[kind].text == "json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise MalformedDataError(f"{path}: not valid JSON: {e}") from e
        if not isinstance(data, list):
            raise MalformedDataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
        return "item", list(enumerate(data, start=1))
    rows: list[tuple[int, object]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            rows.append((n, ValueError(f"not valid JSON: {e.msg}")))
    return "line", rows


def load_examples(kind: str, path: Path, skip_invalid: bool = False) -> tuple[list[Example], list[str]]:
    """Parse ``path``; returns the examples and the problems found (skipped rows when allowed)."""
    if kind not in FORMATS:
        raise ValueError(f"unknown data set {kind!r}; expected one of {sorted(FORMATS)}")
    parse = FORMATS[kind].parse
    unit, raw = _raw_rows(kind, Path(path))
    examples, problems = [], []
    for n, obj in raw:
        try:
            if isinstance(obj, Exception):
                raise obj
            if not isinstance(obj, dict):
                raise ValueError(f"expected an object, got {type(obj).__name__}")
            ex = parse(obj)
            why = answer_problem(kind, ex.answer)
            if why:
                raise ValueError(why)
        except ValueError as e:
            problems.append(f"{path}: {unit} {n}: {e}")
            continue
        examples.append(dataclasses.replace(ex, row=n, dataset=kind))
    if problems and not skip_invalid:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise MalformedDataError(
            f"{len(problems)} malformed row(s) (pass --skip-invalid to drop them):\n  {shown}{more}"
        )
    if not examples:
        raise MalformedDataError(f"{path}: no usable rows")
    return examples, problems


# Values a data set writes where it has no answer; no response can match them, so no row with one can be
# learned from (the reward would score every answer 0 or, for a model that copies the placeholder, 1).
NOT_ANSWERS = ("none", "null", "nil", "nan", "n/a", "na", "unknown", "tbd", "?", "-", "--", "...", "see solution",
               "no answer", "no solution", "undefined")
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def answer_problem(kind: str, answer: str) -> str | None:
    """Why ``answer`` cannot be a ground truth, or None: a placeholder that is no answer, a gsm8k final
    answer that is not a number, or one the recipe's rule reward cannot score 1.0 even when a response
    boxes exactly it (unbalanced braces, an empty box)."""
    if answer.strip().strip("$").strip().lower() in NOT_ANSWERS:
        return f"ground truth {answer!r} is a placeholder, not an answer"
    if kind == "gsm8k" and not _NUMBER.match(answer):
        return f"the final answer {answer!r} after '####' is not a number (gsm8k's answers are numbers)"
    gold = _ground_truth_answer(answer)
    boxed = extract_last_boxed(f"\\boxed{{{answer}}}")
    if not normalize(gold) or boxed is None or normalize(boxed.strip()) != normalize(gold):
        return (f"ground truth {answer!r} cannot be scored: the rule reward reads {boxed!r} from a response that "
                f"boxes it and compares with {gold!r} (unbalanced braces, or an empty box)")
    return None


def to_record(ex: Example, split: str, index: int, data_source: str) -> dict:
    """One row of verl's RL parquet schema (what verl.utils.dataset.rl_dataset reads)."""
    return {
        "data_source": data_source,
        "prompt": [*({"role": r, "content": c} for r, c in ex.context),
                   {"role": "user", "content": f"{ex.question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ex.answer},
        "extra_info": {
            "dataset": ex.dataset,
            "split": split,
            "index": index,
            "source_row": ex.row,
            "question": ex.question,
            "answer": ex.answer,
            "solution": ex.solution,
            **dict(ex.meta),
        },
    }


def split_examples(examples: list[Example], test_size: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Seeded shuffle, then the first ``test_size`` (fraction < 1 or a count) go to test."""
    if not (test_size >= 0 and math.isfinite(test_size)):
        raise ValueError(f"--test-size must be a finite number >= 0, got {test_size}")
    if test_size >= 1 and test_size != int(test_size):
        raise ValueError(f"--test-size {test_size}: a fraction must be < 1, a row count a whole number")
    n_test = round(len(examples) * test_size) if test_size < 1 else int(test_size)
    if n_test >= len(examples):
        raise ValueError(f"test split of {n_test} leaves no training rows out of {len(examples)}")
    if test_size > 0 and n_test == 0:
        raise ValueError(f"--test-size {test_size:g} of {len(examples)} row(s) gives an empty test split (a "
                         "test.parquet without rows or columns, which no reader can use): give a larger fraction, "
                         "a row count, or 0 for no test split (then no test.parquet is written)")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    test = [examples[i] for i in sorted(order[:n_test])]
    train = [examples[i] for i in sorted(order[n_test:])]
    return train, test


class OutputExistsError(FileExistsError):
    """The output directory already holds prepared data and overwriting was not asked for."""


def check_data_source(source: str) -> str:
    if source not in RECIPE_REWARD_SOURCES:
        raise ValueError(f"--data-source {source!r}: the recipe's reward scores only data_source in "
                         f"{sorted(RECIPE_REWARD_SOURCES)} (verl picks the scorer by this column; another value "
                         f"would be scored by a different rule, or not at all)")
    return source


class DownloadError(OSError):
    """--download could not fetch the data set's file (no network, no access, no such file)."""


def download(kind: str) -> Path:
    """Fetch ``kind``'s published file from the Hugging Face hub into huggingface_hub's cache (HF_HOME,
    HF_HUB_CACHE) and return where it lies; a cached copy is reused. DownloadError, naming the source and
    --input, when it cannot."""
    hub = FORMATS[kind].download
    if hub is None:
        known = sorted(k for k, f in FORMATS.items() if f.download)
        raise ValueError(f"--download: no published file is known for {kind!r} (only for {known}); "
                         f"pass the file with --input")
    # Lazy: huggingface_hub and its HTTP stack load only when a download is asked for.
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(hub.repo_id, hub.filename, repo_type="dataset"))
    except Exception as e:  # noqa: BLE001 - no network, no access, no such file: each ends the same way
        why = (str(e).strip().splitlines() or [""])[0][:300]
        raise DownloadError(f"--download: could not fetch {hub} ({type(e).__name__}: {why}); nothing was "
                            f"written. Without network here, fetch it elsewhere (huggingface-cli download "
                            f"--repo-type dataset {hub.repo_id} {hub.filename}) and pass it with --input FILE") from e


def _refuse_existing(out_dir: Path, overwrite: bool) -> None:
    existing = [name for name in OUTPUTS if (out_dir / name).exists()]
    if existing and not overwrite:
        raise OutputExistsError(f"{out_dir} already holds {', '.join(existing)}; pass --overwrite to replace "
                                f"them, or choose another --out-dir")


def prepare(kind: str, input_path: Path | None, out_dir: Path, test_size: float = 0.1, seed: int = 0,
            skip_invalid: bool = False, data_source: str | None = None, overwrite: bool = False,
            fetch: bool = False) -> dict:
    """Write ``train.parquet`` and ``test.parquet`` under ``out_dir``; returns a summary. ``fetch``: the input
    is the kind's published file (``download``), fetched once the output directory is known to be usable.

    Nothing is written unless both splits are complete: each goes to a temporary name first and
    both are renamed at the end. Existing outputs are replaced only with ``overwrite``.
    """
    if kind not in FORMATS:
        raise ValueError(f"unknown data set {kind!r}; expected one of {sorted(FORMATS)}")
    if fetch and input_path:
        raise ValueError(f"--download and --input {input_path} both name the input: give one of them")
    path = Path(input_path) if input_path else SAMPLES[kind]
    if not fetch and not path.is_file():
        raise FileNotFoundError(f"input not found: {path}" + (" (a directory)" if path.is_dir() else ""))
    source = check_data_source(data_source or DEFAULT_DATA_SOURCE[kind])
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"--out-dir {out_dir} exists and is not a directory")
    _refuse_existing(out_dir, overwrite)
    if fetch:
        path = download(kind)
    examples, problems = load_examples(kind, path, skip_invalid=skip_invalid)
    train, test = split_examples(examples, test_size, seed)
    # pyarrow directly (not pandas) so the nested schema and the bytes are the same on every run.
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        # One writer per output directory: a second run into it at the same time is refused by name (it could
        # otherwise pair one run's train.parquet with the other's test.parquet). Checked again under the lock.
        try:
            stack.enter_context(atomic.dir_lock(out_dir, wait=False))
        except atomic.DirLockedError as e:
            raise OutputExistsError(str(e)) from None
        _refuse_existing(out_dir, overwrite)
        # Both temporaries first, renames last: a failure anywhere leaves the old pair intact. No test
        # split (--test-size 0): no test.parquet, and an earlier run's one goes (it is not this run's).
        for split, rows in (("train", train), ("test", test)):
            if not rows:
                continue
            tmp = stack.enter_context(atomic.atomic_path(out_dir / f"{split}.parquet"))
            pq.write_table(pa.Table.from_pylist([to_record(ex, split, i, source) for i, ex in enumerate(rows)]), str(tmp))
        if not test:
            (out_dir / "test.parquet").unlink(missing_ok=True)
    return {"input": str(path), "train": len(train), "test": len(test), "skipped": len(problems),
            "skipped_rows": problems, "out_dir": str(out_dir), "data_source": source}


def main(argv: list[str] | None = None) -> int:
    # Raw: the docstring's list of kinds keeps its lines.
    p = argparse.ArgumentParser(prog="python -m verl_patches.data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=sorted(FORMATS))
    p.add_argument("--input", type=PathArg("input file"), default=None,
                   help="raw file, .parquet or the kind's JSON / JSON lines (default: the shipped sample)")
    p.add_argument("--download", action="store_true",
                   help="fetch the kind's published file from the Hugging Face hub instead: "
                        + "; ".join(f"{k}: {f.download}" for k, f in sorted(FORMATS.items()) if f.download))
    p.add_argument("--out-dir", type=PathArg("output directory"), required=True)
    p.add_argument("--test-size", type=Number(low=0), default=0.1, help="fraction (<1) or row count (>=1)")
    p.add_argument("--seed", type=Integer(low=0, high=2 ** 64 - 1), default=0)
    p.add_argument("--skip-invalid", action="store_true", help="drop malformed rows and report how many")
    p.add_argument("--data-source", type=Text(), default=None,
                   help=f"value of the data_source column, one the recipe's reward scores: {sorted(RECIPE_REWARD_SOURCES)}")
    p.add_argument("--overwrite", action="store_true", help="replace train.parquet / test.parquet already in --out-dir")
    args = p.parse_args(argv)
    try:
        summary = prepare(args.kind, args.input, args.out_dir, args.test_size, args.seed,
                          args.skip_invalid, args.data_source, args.overwrite, args.download)
    except (MalformedDataError, ValueError, OSError) as e:
        msg = e if not isinstance(e, OSError) or isinstance(e, OutputExistsError) or not e.filename else \
            f"{e.filename}: {e.strerror}"
        print(f"error: {msg}", file=sys.stderr)
        return 2
    for line in summary["skipped_rows"]:
        print(f"skipped: {line}", file=sys.stderr)
    print(f"{summary['input']}: train {summary['train']}, test {summary['test']}, "
          f"skipped {summary['skipped']} -> {summary['out_dir']}"
          + (" (no test split: no test.parquet written)" if not summary["test"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
