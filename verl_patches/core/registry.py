"""The registry: every patch record of the overlay, collected from the patch catalogue.

Loading the registry imports our patch modules only; they import no upstream code at
module level, so the doctor and the docs work without the upstream stack importable.
"""

from __future__ import annotations

import importlib
import os

from verl_patches.core.record import Patch, PatchDefinitionError


def load_registry(modules: tuple[str, ...] | None = None) -> list[Patch]:
    """All patch records, in catalogue order; ids must be unique."""
    if modules is None:
        from verl_patches.patches import PATCH_MODULES

        # Extra catalogue modules (a site's own patches; tests use it for fixtures).
        extra = tuple(m.strip() for m in os.environ.get("VERL_PATCHES_EXTRA_MODULES", "").split(",") if m.strip())
        modules = PATCH_MODULES + extra
    seen: dict[str, str] = {}
    out: list[Patch] = []
    for name in modules:
        mod = importlib.import_module(name)
        records = getattr(mod, "PATCHES", None)
        if not isinstance(records, (list, tuple)) or not all(isinstance(p, Patch) for p in records):
            raise PatchDefinitionError(f"{name}: PATCHES must be a list of Patch records")
        for p in records:
            if p.id in seen:
                raise PatchDefinitionError(f"patch id {p.id!r} defined in both {seen[p.id]} and {name}")
            if not p.replacement.startswith(name + ":"):
                raise PatchDefinitionError(
                    f"patch {p.id!r}: replacement {p.replacement!r} must live in its own module {name}")
            seen[p.id] = name
            out.append(p)
    return out


def get_patch(patch_id: str) -> Patch:
    for p in load_registry():
        if p.id == patch_id:
            return p
    raise KeyError(f"no patch with id {patch_id!r} (see `python -m verl_patches patches`)")
