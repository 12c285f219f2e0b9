"""Turn deepscaler JSON and gsm8k JSONL into verl's parquet schema, with a deterministic split.

``python -m verl_patches.data.prepare {deepscaler,gsm8k} [--input F] --out-dir D``; no --input uses the shipped sample.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from verl_patches.base import atomic
from verl_patches.core.lock import REPO_ROOT
from verl_patches.reward import DEEPSCALER_SOURCES
from verl_patches.base.schema import Integer, Number, PathArg, Text
from verl_patches.reward.deepscaler import _ground_truth_answer, extract_last_boxed, normalize

SAMPLES = {
    "deepscaler": REPO_ROOT / "data" / "sample" / "deepscaler_sample.json",
    "gsm8k": REPO_ROOT / "data" / "sample" / "gsm8k_sample.jsonl",
}
# The rule reward (verl_patches.reward.deepscaler) reads the last \boxed{}; the prompt must ask for it.
INSTRUCTION = "Let's think step by step and put the final answer within \\boxed{}."
# verl picks the scorer by data_source: every row must name one that the recipe's reward (the
# boxed-answer rule, reached through verl's default scorer) handles, whatever the data set;
# verl's own "openai/gsm8k" scorer reads "#### answer" and would score every boxed answer 0.
RECIPE_REWARD_SOURCES = DEEPSCALER_SOURCES
DEFAULT_DATA_SOURCE = {"deepscaler": "deepscaler", "gsm8k": "deepscaler"}
OUTPUTS = ("train.parquet", "test.parquet")
_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$")


class MalformedDataError(ValueError):
    """Raised with every bad row listed (1-based row numbers) when skipping was not asked for."""


@dataclass(frozen=True)
class Example:
    question: str
    answer: str
    solution: str
    row: int  # 1-based position in the input file, kept for error messages and extra_info
    dataset: str = ""  # the kind it was read as (deepscaler, gsm8k)


def _require_str(obj: dict, key: str) -> str:
    if key not in obj:
        raise ValueError(f"missing field {key!r}")
    val = obj[key]
    if isinstance(val, (int, float)) and not isinstance(val, bool):
        val = str(val)
    if not isinstance(val, str):
        raise ValueError(f"field {key!r} must be a string, got {type(val).__name__}")
    if not val.strip():
        raise ValueError(f"field {key!r} is empty")
    return val.strip()


def _parse_deepscaler(obj: dict) -> tuple[str, str, str]:
    solution = obj.get("solution", "")
    if not isinstance(solution, str):
        raise ValueError(f"field 'solution' must be a string, got {type(solution).__name__}")
    return _require_str(obj, "problem"), _require_str(obj, "answer"), solution


def _parse_gsm8k(obj: dict) -> tuple[str, str, str]:
    question = _require_str(obj, "question")
    solution = _require_str(obj, "answer")
    m = _GSM8K_FINAL.search(solution)
    if not m:
        raise ValueError("field 'answer' has no '#### <final answer>' line")
    # gsm8k writes thousands separators ("2,520"); the reward compares numbers.
    return question, m.group(1).replace(",", "").strip(), solution


def _raw_rows(kind: str, path: Path) -> list[tuple[int, object]]:
    """(row number, decoded object or the decode error) for every row of the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MalformedDataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if kind == "deepscaler":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise MalformedDataError(f"{path}: not valid JSON: {e}") from e
        if not isinstance(data, list):
            raise MalformedDataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
        return list(enumerate(data, start=1))
    rows: list[tuple[int, object]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            rows.append((n, ValueError(f"not valid JSON: {e.msg}")))
    return rows


def load_examples(kind: str, path: Path, skip_invalid: bool = False) -> tuple[list[Example], list[str]]:
    """Parse ``path``; returns the examples and the problems found (skipped rows when allowed)."""
    if kind not in SAMPLES:
        raise ValueError(f"unknown data set {kind!r}; expected one of {sorted(SAMPLES)}")
    parse = _parse_deepscaler if kind == "deepscaler" else _parse_gsm8k
    unit = "item" if kind == "deepscaler" else "line"
    examples, problems = [], []
    for n, obj in _raw_rows(kind, Path(path)):
        try:
            if isinstance(obj, Exception):
                raise obj
            if not isinstance(obj, dict):
                raise ValueError(f"expected an object, got {type(obj).__name__}")
            q, a, s = parse(obj)
            why = answer_problem(kind, a)
            if why:
                raise ValueError(why)
        except ValueError as e:
            problems.append(f"{path}: {unit} {n}: {e}")
            continue
        examples.append(Example(q, a, s, n, kind))
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
        "prompt": [{"role": "user", "content": f"{ex.question} {INSTRUCTION}"}],
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


def prepare(kind: str, input_path: Path | None, out_dir: Path, test_size: float = 0.1, seed: int = 0,
            skip_invalid: bool = False, data_source: str | None = None, overwrite: bool = False) -> dict:
    """Write ``train.parquet`` and ``test.parquet`` under ``out_dir``; returns a summary.

    Nothing is written unless both splits are complete: each goes to a temporary name first and
    both are renamed at the end. Existing outputs are replaced only with ``overwrite``.
    """
    path = Path(input_path) if input_path else SAMPLES[kind]
    if not path.is_file():
        raise FileNotFoundError(f"input not found: {path}" + (" (a directory)" if path.is_dir() else ""))
    source = check_data_source(data_source or DEFAULT_DATA_SOURCE[kind])
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"--out-dir {out_dir} exists and is not a directory")
    existing = [name for name in OUTPUTS if (out_dir / name).exists()]
    if existing and not overwrite:
        raise OutputExistsError(f"{out_dir} already holds {', '.join(existing)}; pass --overwrite to replace "
                                f"them, or choose another --out-dir")
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
        existing = [name for name in OUTPUTS if (out_dir / name).exists()]
        if existing and not overwrite:
            raise OutputExistsError(f"{out_dir} already holds {', '.join(existing)}; pass --overwrite to replace "
                                    f"them, or choose another --out-dir")
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
    p = argparse.ArgumentParser(prog="python -m verl_patches.data.prepare", description=__doc__)
    p.add_argument("kind", choices=sorted(SAMPLES))
    p.add_argument("--input", type=PathArg("input file"), default=None, help="raw file (default: the shipped sample)")
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
                          args.skip_invalid, args.data_source, args.overwrite)
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
