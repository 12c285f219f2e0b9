"""The repository stands on its own: no tracked file cites a Markdown document the repository does not
have, and none names a path of a development machine.

A citation is a token ending in ``.md`` that has a directory part, an upper-case letter in its name, or
sits in backticks (``self.md`` in Python is an attribute, not a document); it must resolve against the
repository root, the citing file's folder, or docs/. URLs are not citations. This file is not scanned:
its own examples are deliberately missing documents.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKEN = re.compile(r"(`?)((?:\.\.?/)?(?:[\w.-]+/)*[\w-]+\.md)\b(`?)")
# Home and work folders of development machines; the checkout's own folders are named relative to it.
MACHINE_PATH = re.compile(r"(?<![\w.~$}-])/(?:work|home|Users|root)/[\w.-]")
SKIP_SUFFIXES = {".png", ".jpg", ".gz", ".parquet", ".pyc"}


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):  # an exported tree without git: every file under the root
        names = [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()
                 and not any(part.startswith(".") or part in ("out", "build") for part in p.relative_to(REPO).parts)]
    me = Path(__file__).resolve()
    return [REPO / n for n in names
            if Path(n).suffix not in SKIP_SUFFIXES and (REPO / n).is_file() and (REPO / n).resolve() != me]


def citations(text: str) -> list[tuple[int, str]]:
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for word in re.split(r"[\s\"'(\[<>,;]+", line):
            if "://" in word:
                continue
            for m in TOKEN.finditer(word):
                path = m.group(2)
                stem = Path(path).stem
                if "/" in path or re.search(r"[A-Z]", stem) or (m.group(1) and m.group(3)):
                    found.append((lineno, path))
    return found


def resolves(path: str, citing: Path) -> bool:
    """The cited file exists inside the repository (a path that leaves it, like ../elsewhere/..., does not count
    even when the development machine happens to have it)."""
    root = REPO.resolve()
    for base in (REPO, citing.parent, REPO / "docs"):
        cand = (base / path).resolve()
        if cand.is_relative_to(root) and cand.exists():
            return True
    return False


def test_no_tracked_file_cites_a_document_the_repository_does_not_have():
    missing = []
    for f in tracked_files():
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        missing += [f"{f.relative_to(REPO)}:{n}: {p}" for n, p in citations(text) if not resolves(p, f)]
    assert not missing, "cites documents the repository does not have:\n" + "\n".join(missing)


def test_no_tracked_file_names_a_development_machines_path():
    found = []
    for f in tracked_files():
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{f.relative_to(REPO)}:{n}: {line.strip()[:120]}" for n, line in enumerate(text.splitlines(), 1)
                  if MACHINE_PATH.search(line)]
    assert not found, "machine paths in tracked files:\n" + "\n".join(found)


def test_the_checks_catch_what_they_are_for():
    citing = REPO / "verl_patches" / "x.py"
    # Names of documents nobody has, put together here so that this file does not cite them itself.
    outside, nowhere = "../elsewhere/" + "NOTES" + ".md", "NOWHERE" + ".md"
    cited = [p for _, p in citations(f"see RECIPE.md item 3, docs/DESIGN.md section 2 and {outside}; "
                                     "self.md = 1; https://example.org/README.md `benchmarks.md`")]
    assert sorted(cited) == [outside, "RECIPE.md", "benchmarks.md", "docs/DESIGN.md"]
    assert resolves("docs/DESIGN.md", citing) and resolves("benchmarks.md", citing)
    assert not resolves(outside, citing) and not resolves(nowhere, citing)
    assert MACHINE_PATH.search("# from " + "/work" + "/elsewhere/spec") and MACHINE_PATH.search("/home" + "/alice/x")
    assert not MACHINE_PATH.search("${HOME}/models /opt/recipe /usr/local/Ascend /tmp/ray_recipe")
