"""docs/RECIPE.md "The reward compared with the reference's": every example row, scored by both rules.

The reference's rule as documented there (1 when the ground truth occurs anywhere in the response or
equals the last boxed answer exactly) is written out here in two lines; ours is the real
verl_patches.reward.deepscaler.compute_score. The table's columns must match both.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_patches.reward.deepscaler import compute_score, extract_last_boxed

DOC = Path(__file__).resolve().parents[2] / "docs" / "RECIPE.md"


def reference_rule(response: str, ground_truth: str) -> float:
    return 1.0 if ground_truth in response or extract_last_boxed(response) == ground_truth else 0.0


def rows():
    section = DOC.read_text().split("## The reward compared with the reference's", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`") and cells[2] in ("0", "1"):
            out.append((cells[0].strip("`"), cells[1].strip("`"), float(cells[2]), float(cells[3]), cells[4]))
    return out


def test_the_table_has_examples_each_way():
    r = rows()
    assert len(r) >= 6
    assert any(ref > ours for _, _, ref, ours, _ in r) and any(ours > ref for _, _, ref, ours, _ in r)


@pytest.mark.parametrize("response, truth, ref, ours, why", rows(), ids=lambda x: str(x)[:30])
def test_each_example_scores_as_documented(response, truth, ref, ours, why):
    assert reference_rule(response, truth) == ref, why
    assert compute_score("deepscaler", response, truth) == ours, why
