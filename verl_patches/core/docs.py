"""docs/PATCHES.md, generated from the registry (a test fails when the file is stale)."""

from __future__ import annotations

from verl_patches.core.lock import REPO_ROOT
from verl_patches.core.record import Patch

PATCHES_MD = REPO_ROOT / "docs" / "PATCHES.md"


def render_patches_md(patches: list[Patch]) -> str:
    out = [
        "# Patches",
        "",
        "Generated from the registry by `python -m verl_patches docs --write`; do not edit by hand.",
        "`python -m verl_patches diff ID` shows each replacement next to the upstream original.",
        "",
    ]
    if not patches:
        out += ["No patches are registered yet.", ""]
        return "\n".join(out)
    out += ["| id | target | kind | phases | upstream | flag |", "|---|---|---|---|---|---|"]
    for p in patches:
        out.append(f"| [{p.id}](#{p.id}) | `{p.target}` | {p.kind} | {', '.join(p.phases)} "
                   f"| {p.upstream} {p.versions} | {f'`{p.flag}`' if p.flag else '-'} |")
    out.append("")
    for p in patches:
        out += [
            f"## {p.id}",
            "",
            f"- **target**: `{p.target}` ({p.kind}, applied in: {', '.join(p.phases)}"
            + (f"; only on: {', '.join(p.platforms)})" if p.platforms else ")"),
            f"- **upstream**: {p.upstream} {p.versions}; fingerprint `{p.fingerprint}`",
            f"- **ours**: `{p.replacement}`",
            f"- **flag**: {f'`{p.flag}`' if p.flag else 'always on when the prelude runs'}",
            f"- **why**: {p.why}",
            f"- **remove when**: {p.remove_when}",
        ]
        if p.upstream_ref:
            out.append(f"- **upstream reference**: {p.upstream_ref}")
        out.append("")
    return "\n".join(out)
