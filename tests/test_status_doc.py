"""docs/STATUS.md is the present state, short: no issue numbers and no commit hashes (the history is
git's), every area has its section, and it stays under about 100 lines."""

from __future__ import annotations

import re

from tests.helpers import REPO

DOC = REPO / "docs" / "STATUS.md"
AREAS = ("Reshard", "Switch and offload", "Graph-safe switch", "TensorCache", "Old log-prob reuse", "DP domain",
         "Reward", "The tiny run", "The Ascend path (NPU rehearsal platform)", "Several nodes", "Checkpoints", "NVIDIA", "Self-checks", "Tests and CI")


def test_status_is_short_and_names_no_issue_or_commit():
    text = DOC.read_text()
    assert len(text.splitlines()) <= 110
    assert not re.search(r"(?i)\bissues?\s*#?\d+|#\d+\b", text), "issue numbers belong to the history"
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert not hashes, f"commit hashes belong to the history: {hashes}"


def test_status_has_every_area():
    headings = re.findall(r"^## (.+)$", DOC.read_text(), flags=re.M)
    assert list(AREAS) == headings
