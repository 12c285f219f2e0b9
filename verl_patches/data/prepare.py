"""Turn deepscaler JSON and gsm8k JSONL into verl's parquet schema, with a deterministic split.

``python -m verl_patches.data.prepare {deepscaler,gsm8k} [--input F] --out-dir D``; no --input uses the shipped sample.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLES = {
    "deepscaler": REPO_ROOT / "data" / "sample" / "deepscaler_sample.json",
    "gsm8k": REPO_ROOT / "data" / "sample" / "gsm8k_sample.jsonl",
}
# The rule reward (verl_patches.reward.deepscaler) reads the last \boxed{}; the prompt must ask for it.
INSTRUCTION = "Let's think step by step and put the final answer within \\boxed{}."
DEFAULT_DATA_SOURCE = {"deepscaler": "deepscaler", "gsm8k": "gsm8k"}
_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$")


class MalformedDataError(ValueError):
    """Raised with every bad row listed (1-based row numbers) when skipping was not asked for."""


@dataclass(frozen=True)
class Example:
    question: str
    answer: str
    solution: str
    row: int  # 1-based position in the input file, kept for error messages and extra_info


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
    text = path.read_text(encoding="utf-8")
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
        except ValueError as e:
            problems.append(f"{path}: {unit} {n}: {e}")
            continue
        examples.append(Example(q, a, s, n))
    if problems and not skip_invalid:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise MalformedDataError(
            f"{len(problems)} malformed row(s) (pass --skip-invalid to drop them):\n  {shown}{more}"
        )
    if not examples:
        raise MalformedDataError(f"{path}: no usable rows")
    return examples, problems


def to_record(ex: Example, split: str, index: int, data_source: str) -> dict:
    """One row of verl's RL parquet schema (what verl.utils.dataset.rl_dataset reads)."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{ex.question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ex.answer},
        "extra_info": {
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
    if test_size < 0:
        raise ValueError(f"test_size must be >= 0, got {test_size}")
    n_test = round(len(examples) * test_size) if test_size < 1 else int(test_size)
    if n_test >= len(examples):
        raise ValueError(f"test split of {n_test} leaves no training rows out of {len(examples)}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    test = [examples[i] for i in sorted(order[:n_test])]
    train = [examples[i] for i in sorted(order[n_test:])]
    return train, test


def write_parquet(records: list[dict], path: Path) -> None:
    # pyarrow directly (not pandas) so the nested schema and the bytes are the same on every run.
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(records)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def prepare(kind: str, input_path: Path | None, out_dir: Path, test_size: float = 0.1, seed: int = 0,
            skip_invalid: bool = False, data_source: str | None = None) -> dict:
    """Write ``train.parquet`` and ``test.parquet`` under ``out_dir``; returns a summary."""
    path = Path(input_path) if input_path else SAMPLES[kind]
    if not path.is_file():
        raise FileNotFoundError(f"input not found: {path}")
    examples, problems = load_examples(kind, path, skip_invalid=skip_invalid)
    train, test = split_examples(examples, test_size, seed)
    source = data_source or DEFAULT_DATA_SOURCE[kind]
    out_dir = Path(out_dir)
    for split, rows in (("train", train), ("test", test)):
        write_parquet([to_record(ex, split, i, source) for i, ex in enumerate(rows)], out_dir / f"{split}.parquet")
    return {"input": str(path), "train": len(train), "test": len(test), "skipped": len(problems),
            "skipped_rows": problems, "out_dir": str(out_dir)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches.data.prepare", description=__doc__)
    p.add_argument("kind", choices=sorted(SAMPLES))
    p.add_argument("--input", type=Path, default=None, help="raw file (default: the shipped sample)")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--test-size", type=float, default=0.1, help="fraction (<1) or row count (>=1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-invalid", action="store_true", help="drop malformed rows and report how many")
    p.add_argument("--data-source", default=None, help="value of the data_source column")
    args = p.parse_args(argv)
    try:
        summary = prepare(args.kind, args.input, args.out_dir, args.test_size, args.seed,
                          args.skip_invalid, args.data_source)
    except (MalformedDataError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in summary["skipped_rows"]:
        print(f"skipped: {line}", file=sys.stderr)
    print(f"{summary['input']}: train {summary['train']}, test {summary['test']}, "
          f"skipped {summary['skipped']} -> {summary['out_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
