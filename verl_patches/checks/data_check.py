"""Check a run's parquet files against what the recipe reads, and that its reward can score them.

Every row of every file is read, in record batches (bounded memory whatever the file's size), and
checked for the columns verl's RL dataset and reward manager use, with their types: a string
``data_source``; a ``prompt`` (``data.prompt_key``) that is a non-empty list of ``{role, content}``
messages; ``reward_model.ground_truth`` a non-empty string or a finite number; ``extra_info``, when
present, a struct in every row. Each problem names the file, the row (counted from 1) and the column.

verl picks the scorer per row by ``data_source``; a source it has no scorer for fails the first
training step, one whose scorer expects another answer format scores every answer 0. Each
distinct source is tried with a correct ``\\boxed{}`` answer (what the prompts ask for), or with the
answer a custom reward module names for it (``correct_answer(data_source, ground_truth)``, None for
the boxed one). The recipe's reward patch is in place while probing, as in the trainer's driver.

Rows scored by the boxed-answer rule are checked for what that rule needs in every row: a ground truth a boxed
answer can match (by the rule of the data set named in ``extra_info.dataset``: a number for gsm8k), and no
message asking for another answer format (DAPO-Math-17k's own prompts ask for a last line "Answer: ...", which
that rule scores 0; ``prepare dapo_math`` replaces it).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from verl_patches.reporting.findings import finish
from verl_patches.base.schema import PathArg, Text
from verl_patches.core.apply import apply_all, undo
from verl_patches.data.prepare import FORMATS, answer_format_problem, answer_problem
from verl_patches.patches import get_patch
from verl_patches.reward import DEEPSCALER_SOURCES

REWARD_PATCH = "verl.reward_score.deepscaler"
# Rows scored per data source: enough to catch a scorer that rejects the source, cheap on 40k rows.
# (Every row's columns and types are checked; scoring is what is sampled.)
PROBES_PER_SOURCE = 3
# Rows per record batch: what the check holds in memory at once, whatever the file's size.
BATCH_ROWS = 4096
# Rows reported one by one per file; the rest are counted.
MAX_ROW_PROBLEMS = 20
# The columns the recipe reads: verl's RLHFDataset (the prompt, extra_info.index) and its reward
# manager (data_source, reward_model.ground_truth, extra_info).
DATA_SOURCE, PROMPT_KEY, REWARD_MODEL, GROUND_TRUTH, EXTRA_INFO = (
    "data_source", "prompt", "reward_model", "ground_truth", "extra_info")


def recipe_scorer(config: Any = None) -> tuple[Callable[..., Any], str]:
    """(scorer, description) for ``config``: its custom_reward_function when it names one (loaded
    by verl's own loader; it may call verl's default scorer, so the recipe's reward patch is applied
    around each call), else verl's default scorer with that patch."""
    if config is not None:
        custom = (config.get("custom_reward_function") or {}) if hasattr(config, "get") else {}
        if custom.get("path"):
            # Lazy: verl and pyarrow load when data is checked (the recipe's validator imports this module for its
            # rules).
            from verl.trainer.ppo.reward import get_custom_reward_fn

            fn = get_custom_reward_fn(config)
            spec = importlib.util.spec_from_file_location("_reward_probe_module", custom["path"])
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            answer = getattr(module, "correct_answer", None)

            def scorer(src, solution, gt, extra):
                done = apply_all([get_patch(REWARD_PATCH)])
                try:
                    return fn(src, solution, gt, extra)
                finally:
                    undo(done)

            scorer.correct_answer = answer  # type: ignore[attr-defined]
            return scorer, f"custom_reward_function {custom.get('path')}:{custom.get('name')}"
    # Lazy: verl and pyarrow load when data is checked (the recipe's validator imports this module for its rules).
    from verl.utils.reward_score import default_compute_score

    wrap = get_patch(REWARD_PATCH).load_replacement()
    return wrap(default_compute_score), f"verl's default_compute_score with the patch {REWARD_PATCH}"


def _is_text(t) -> bool:
    # Lazy: verl and pyarrow load when data is checked (the recipe's validator imports this module for its rules).
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_number(t) -> bool:
    # Lazy: verl and pyarrow load when data is checked (the recipe's validator imports this module for its rules).
    import pyarrow as pa

    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _field(t, name: str):
    idx = t.get_field_index(name)
    return None if idx < 0 else t.field(idx).type


def schema_problems(schema, prompt_key: str = PROMPT_KEY) -> list[str]:
    """What is wrong with a file's columns for the recipe (empty when nothing): the columns verl's
    RL dataset and reward manager read, with the types they need."""
    # Lazy: verl and pyarrow load when data is checked (the recipe's validator imports this module for its rules).
    import pyarrow as pa

    missing = [c for c in (DATA_SOURCE, prompt_key, REWARD_MODEL) if schema.get_field_index(c) < 0]
    if missing:
        return [f"no column(s) {missing} (the recipe reads {DATA_SOURCE}, {prompt_key}, {REWARD_MODEL}."
                f"ground_truth; has {schema.names})"]
    out = []
    t = schema.field(DATA_SOURCE).type
    if not _is_text(t):
        out.append(f"column {DATA_SOURCE} is {t}, must be string (verl picks the scorer by it)")
    t = schema.field(prompt_key).type
    msg = t.value_type if (pa.types.is_list(t) or pa.types.is_large_list(t)) else None
    if msg is None or not pa.types.is_struct(msg) or not all(
            _field(msg, k) is not None and _is_text(_field(msg, k)) for k in ("role", "content")):
        out.append(f"column {prompt_key} is {t}, must be a list of {{role: string, content: string}} messages "
                   "(verl applies the chat template to it)")
    t = schema.field(REWARD_MODEL).type
    gt = _field(t, GROUND_TRUTH) if pa.types.is_struct(t) else None
    if gt is None or not (_is_text(gt) or _is_number(gt)):
        out.append(f"column {REWARD_MODEL} is {t}, must be a struct with a string or number {GROUND_TRUTH} "
                   "(the reward compares answers with it)")
    if schema.get_field_index(EXTRA_INFO) >= 0 and not pa.types.is_struct(schema.field(EXTRA_INFO).type):
        out.append(f"column {EXTRA_INFO} is {schema.field(EXTRA_INFO).type}, must be a struct (verl reads "
                   f"{EXTRA_INFO}.index)")
    return out


def _boxed_sources() -> frozenset:
    return frozenset(DEEPSCALER_SOURCES)


def row_problems(row: dict[str, Any], prompt_key: str = PROMPT_KEY) -> list[tuple[str, str]]:
    """(column, problem) for one row whose columns have the right types."""
    out = []
    src = row.get(DATA_SOURCE)
    if src is None or not str(src).strip():
        out.append((DATA_SOURCE, "null or empty"))
    prompt = row.get(prompt_key)
    if not prompt:
        out.append((prompt_key, "null or no messages"))
    else:
        for i, m in enumerate(prompt):
            if not m or not (m.get("role") or "").strip() or m.get("content") is None:
                out.append((f"{prompt_key}[{i}]", "a message without a role or content"))
                break
        else:
            if not any((m.get("content") or "").strip() for m in prompt):
                out.append((prompt_key, "every message's content is empty"))
            elif src in _boxed_sources():
                # A prompt that asks for another answer format than the reward reads (DAPO's "Answer: ..." line,
                # kept by a copy not made by prepare) trains on rewards that are 0 for every right answer.
                out += [(f"{prompt_key}[{i}]", why) for i, m in enumerate(prompt)
                        if (why := answer_format_problem(m.get("content") or ""))][:1]
    rm = row.get(REWARD_MODEL)
    gt = rm.get(GROUND_TRUTH) if isinstance(rm, dict) else None
    if rm is None:
        out.append((REWARD_MODEL, "null"))
    elif gt is None or (isinstance(gt, str) and not gt.strip()):
        out.append((f"{REWARD_MODEL}.{GROUND_TRUTH}", "null or empty"))
    elif isinstance(gt, float) and not math.isfinite(gt):
        out.append((f"{REWARD_MODEL}.{GROUND_TRUTH}", f"{gt} is not a finite number"))
    elif isinstance(gt, str) and src in _boxed_sources():
        # The recipe's boxed-answer rule scores these rows: a value no response can match is no ground truth
        # (the same rule as the data preparation's, verl_patches/data/prepare.py answer_problem).
        # A row prepare wrote names its kind in extra_info.dataset; that kind's own rule applies (gsm8k: a number).
        extra = row.get(EXTRA_INFO) if isinstance(row.get(EXTRA_INFO), dict) else {}
        why = answer_problem(extra.get("dataset") if extra.get("dataset") in FORMATS else "deepscaler", gt)
        if why:
            out.append((f"{REWARD_MODEL}.{GROUND_TRUTH}", why))
    if EXTRA_INFO in row and row[EXTRA_INFO] is None:
        out.append((EXTRA_INFO, "null (verl reads extra_info.index from every row)"))
    return out


def scan(path: Path, problems: list[str], prompt_key: str = PROMPT_KEY,
         batch_rows: int = BATCH_ROWS) -> Iterator[tuple[str, Any]]:
    """Read every row of a verl RL parquet file in record batches of ``batch_rows`` (bounded
    memory), append one message per problem to ``problems`` (the first ``MAX_ROW_PROBLEMS`` rows
    with one, then a count), and yield (data_source, ground truth) of each sound row."""
    # Lazy: verl and pyarrow load when data is checked (the recipe's validator imports this module for its rules).
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
        schema = pf.schema_arrow
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        problems.append(f"{path}: not a verl RL parquet file ({type(e).__name__}: {e})")
        return
    bad_schema = schema_problems(schema, prompt_key)
    if bad_schema:
        problems += [f"{path}: {m}" for m in bad_schema]
        return
    columns = [DATA_SOURCE, prompt_key, REWARD_MODEL] + ([EXTRA_INFO] if schema.get_field_index(EXTRA_INFO) >= 0 else [])
    n, bad_rows = 0, 0
    try:
        for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
            for row in batch.to_pylist():
                n += 1
                found = row_problems(row, prompt_key)
                if found:
                    bad_rows += 1
                    if bad_rows <= MAX_ROW_PROBLEMS:
                        problems.append(f"{path}: row {n}: " + "; ".join(f"column {c}: {p}" for c, p in found))
                    continue
                yield row[DATA_SOURCE], row[REWARD_MODEL][GROUND_TRUTH]
    except Exception as e:  # noqa: BLE001 - a damaged row group reads as any pyarrow error
        problems.append(f"{path}: unreadable after row {n} ({type(e).__name__}: {e})")
        return
    if bad_rows > MAX_ROW_PROBLEMS:
        problems.append(f"{path}: and {bad_rows - MAX_ROW_PROBLEMS} more row(s) with problems "
                        f"({bad_rows} of {n})")
    if n == 0:
        problems.append(f"{path}: no rows")


def read_rows(path: Path, prompt_key: str = PROMPT_KEY) -> list[tuple[str, Any]]:
    """(data_source, ground truth) of every sound row; ValueError naming every problem found."""
    problems: list[str] = []
    rows = list(scan(Path(path), problems, prompt_key))
    if problems:
        raise ValueError("\n".join(problems))
    return rows


def _score_value(result: Any) -> Any:
    return result.get("score") if isinstance(result, dict) else result


def unscorable(rows: Iterable[tuple[str, Any]], scorer: Callable[..., Any], where: str) -> list[str]:
    """One message per data source that ``scorer`` cannot score right (empty when all can)."""
    counts: Counter = Counter()
    probes: dict[Any, list[Any]] = {}
    for src, gt in rows:
        counts[src] += 1
        if len(probes.setdefault(src, [])) < PROBES_PER_SOURCE:
            probes[src].append(gt)
    problems = []
    for src, gts in probes.items():
        label = f"{where}: data_source {src!r} ({counts[src]} row(s))"
        if not isinstance(src, str):
            problems.append(f"{label}: data_source must be a string")
            continue
        for gt in gts:
            if gt is None:
                problems.append(f"{label}: a row has no reward_model.ground_truth")
                break
            named = getattr(scorer, "correct_answer", None)
            answer = (named(src, gt) if named else None) or f"So the answer is \\boxed{{{gt}}}."
            try:
                score = _score_value(scorer(src, answer, gt, {}))
            except NotImplementedError:
                problems.append(f"{label}: the reward has no scorer for this data_source")
                break
            except Exception as e:  # noqa: BLE001 - any scorer failure is reported the same way
                problems.append(f"{label}: the reward fails on it: {type(e).__name__}: {e}")
                break
            if score != 1.0:
                problems.append(f"{label}: a correct answer ({answer!r}) scores {score!r}, not 1.0: this "
                                "scorer expects another answer format than the prompts ask for")
                break
    return problems


def check_files(files: Iterable[Path], scorer: Callable[..., Any], prompt_key: str = PROMPT_KEY) -> list[str]:
    """Every problem of every file: its columns and types, every row, and whether ``scorer``
    scores a correct answer of each data source 1.0. Streams each file (bounded memory)."""
    problems: list[str] = []
    for f in files:
        found: list[str] = []
        scoring = unscorable(scan(Path(f), found, prompt_key), scorer, str(f))
        problems += found + scoring
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches.checks.data_check", description=__doc__)
    p.add_argument("files", nargs="+", type=PathArg("parquet file"), help="verl RL parquet files (train / val)")
    p.add_argument("--prompt-key", type=Text(), default=PROMPT_KEY, help="the prompt column (verl's data.prompt_key)")
    args = p.parse_args(argv)
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        print(f"error: not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    scorer, what = recipe_scorer()
    return finish(check_files(args.files, scorer, args.prompt_key),
                  f"every row of {len(args.files)} file(s) has the recipe's columns; every data source is scored by {what}")


if __name__ == "__main__":
    sys.exit(main())
