"""docs/PATCHES.md, generated from the registry (a test fails when the file is stale): the patches
grouped by feature, in the order the prelude applies them, with what each needs and the upstream
lines it answers."""

from __future__ import annotations

import re
from pathlib import Path

from verl_patches.core.features import FEATURES
from verl_patches.core.lock import REPO_ROOT, load_lock
from verl_patches.core.record import Patch
from verl_patches.core.fingerprint import TargetNotFound, source_span
from verl_patches.core.upstream import module_file

PATCHES_MD = REPO_ROOT / "docs" / "PATCHES.md"


NOT_INSTALLED = "(not installed here)"


def upstream_lines(patch: Patch, root: Path | None = None) -> str:
    """``<component> <locked version> <path in the package>#L<first>-L<last>``: the definition the
    patch replaces or wraps, read from the installed upstream (the fingerprint pins its text)."""
    comp = load_lock().get(patch.upstream)
    version = comp.version if comp else "?"
    path = module_file(patch.module, root)
    if path is None:
        return f"{patch.upstream} {version} {NOT_INSTALLED}"
    rel = patch.module.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")
    try:
        span = source_span(path, patch.qualname)
    except TargetNotFound:
        return f"{patch.upstream} {version} {rel} (target not found: `python -m verl_patches doctor`)"
    return f"{patch.upstream} {version} {rel}#L{span.first_line}-L{span.last_line}"


def committed_upstream_lines(text: str) -> dict[str, str]:
    """The *upstream lines* entry of each patch in a rendered PATCHES.md, by patch id."""
    found: dict[str, str] = {}
    for m in re.finditer(r"^### (\S+)\n(?:(?!### ).*\n)*?- \*\*upstream lines\*\*: (.*)$", text, re.M):
        found[m.group(1)] = m.group(2)
    return found


def _lines(p: Patch, kept: dict[str, str], unread: list[str] | None) -> str:
    line = upstream_lines(p)
    if not line.endswith(NOT_INSTALLED):
        return line
    if unread is not None:
        unread.append(p.id)
    old = kept.get(p.id, "")
    # Only a committed entry for the same component and locked version stands in for the read.
    return old if old.startswith(line[: -len(NOT_INSTALLED)]) and not old.endswith(NOT_INSTALLED) else line


def _ids(ids: tuple[str, ...]) -> str:
    return ", ".join(f"[{i}](#{i})" for i in ids) if ids else "-"


def render_patches_md(patches: list[Patch], committed: str = "",
                      unread: list[str] | None = None) -> str:
    """The document. A patch whose upstream is not installed here (MindSpeed on a machine without
    its release archive) keeps the *upstream lines* entry of ``committed`` (the file as it stands),
    so the document does not depend on which optional upstreams a machine has; the ids of such
    patches are appended to ``unread`` for the caller to report."""
    kept = committed_upstream_lines(committed)
    out = [
        "# Patches",
        "",
        "Generated from the registry by `python -m verl_patches docs --write`; do not edit by hand.",
        "`python -m verl_patches diff ID` shows each replacement next to the upstream original.",
        "Grouped by feature; within a feature, in the order the prelude applies them. *requires*: patches",
        "that must be applied (earlier, in the same process) for this one to work; *after*: patches this",
        "one is applied after when they apply too (it then wraps outside them). The applier refuses a",
        "patch whose requirements were not applied. *upstream lines*: the definition it replaces or",
        "wraps in the locked release.",
        "",
    ]
    if not patches:
        out += ["No patches are registered yet.", ""]
        return "\n".join(out)
    groups = {f: [p for p in patches if p.feature == f] for f in FEATURES}
    out += ["| feature | patches | what |", "|---|---|---|"]
    for f, ps in groups.items():
        if ps:
            out.append(f"| [{f}](#feature-{f}) | {len(ps)} | {FEATURES[f]} |")
    out.append("")
    for f, ps in groups.items():
        if not ps:
            continue
        out += [f"## Feature: {f}", "", FEATURES[f], "",
                "| id | target | kind | phases | requires | after | flag |", "|---|---|---|---|---|---|---|"]
        for p in ps:
            out.append(f"| [{p.id}](#{p.id}) | `{p.target}` | {p.kind} | {', '.join(p.phases)} "
                       f"| {_ids(p.requires)} | {_ids(p.after)} | {f'`{p.flag}`' if p.flag else '-'} |")
        out.append("")
        for p in ps:
            out += [
                f"### {p.id}",
                "",
                f"- **target**: `{p.target}` ({p.kind}, applied in: {', '.join(p.phases)}"
                + (f"; only on: {', '.join(p.platforms)})" if p.platforms else ")"),
                f"- **upstream**: {p.upstream} {p.versions}; fingerprint `{p.fingerprint}`",
                f"- **upstream lines**: {_lines(p, kept, unread)}",
            ]
            if p.upstream_ref:
                out.append(f"- **upstream reference**: {p.upstream_ref}")
            if p.requires or p.after:
                out.append(f"- **requires**: {_ids(p.requires)}; **after**: {_ids(p.after)}")
            out += [
                f"- **ours**: `{p.replacement}`",
                f"- **flag**: {f'`{p.flag}`' if p.flag else 'always on when the prelude runs'}",
                f"- **why**: {p.why}",
                f"- **remove when**: {p.remove_when}",
                "",
            ]
    return "\n".join(out)
