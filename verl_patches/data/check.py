"""Check that the reward a run configures can score every data source in its parquet files.

verl picks the scorer per row by ``data_source``; a source it has no scorer for fails the first
training step, one whose scorer expects another answer format scores every answer 0. Each
distinct source is tried with a correct ``\\boxed{}`` answer (what the prompts ask for), or with the
answer a custom reward module names for it (``correct_answer(data_source, ground_truth)``, None for
the boxed one). The recipe's reward patch is in place while probing, as in the trainer's driver.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable

REWARD_PATCH = "verl.reward_score.deepscaler"
# Rows tried per data source: enough to catch a scorer that rejects the source, cheap on 40k rows.
PROBES_PER_SOURCE = 3


def recipe_scorer(config: Any = None) -> tuple[Callable[..., Any], str]:
    """(scorer, description) for ``config``: its custom_reward_function when it names one (loaded
    by verl's own loader; it may call verl's default scorer, so the recipe's reward patch is applied
    around each call), else verl's default scorer with that patch."""
    from verl_patches.core.registry import get_patch

    if config is not None:
        custom = (config.get("custom_reward_function") or {}) if hasattr(config, "get") else {}
        if custom.get("path"):
            import importlib.util

            from verl.trainer.ppo.reward import get_custom_reward_fn

            from verl_patches.core.apply import apply_all, undo

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
    from verl.utils.reward_score import default_compute_score

    wrap = get_patch(REWARD_PATCH).load_replacement()
    return wrap(default_compute_score), f"verl's default_compute_score with the patch {REWARD_PATCH}"


def read_rows(path: Path) -> list[tuple[str, Any]]:
    """(data_source, ground truth) of every row of a verl RL parquet file."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(str(path), columns=["data_source", "reward_model"])
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise ValueError(f"{path}: not a verl RL parquet file with data_source and reward_model columns ({e})") from None
    out = []
    for src, rm in zip(table.column("data_source").to_pylist(), table.column("reward_model").to_pylist()):
        out.append((src, (rm or {}).get("ground_truth") if isinstance(rm, dict) else None))
    return out


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


def check_files(files: Iterable[Path], scorer: Callable[..., Any]) -> list[str]:
    problems: list[str] = []
    for f in files:
        try:
            problems += unscorable(read_rows(Path(f)), scorer, str(f))
        except ValueError as e:
            problems.append(str(e))
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches.data.check", description=__doc__)
    p.add_argument("files", nargs="+", type=Path, help="verl RL parquet files (train / val)")
    args = p.parse_args(argv)
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        print(f"error: not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    scorer, what = recipe_scorer()
    problems = check_files(args.files, scorer)
    for msg in problems:
        print(f"error: {msg}", file=sys.stderr)
    if problems:
        return 1
    print(f"every data source in {len(args.files)} file(s) is scored by {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
