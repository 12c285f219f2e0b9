"""The registry: the patch records of the modules it is handed, checked as one catalogue.

The catalogue (verl_patches/patches/__init__.py: load_catalogue) hands it the overlay's modules; core/
names no patch module itself, so every import edge points down. Loading imports our patch modules only;
they import no upstream code at module level, so the doctor and the docs work without the upstream
stack importable.
"""

from __future__ import annotations

import importlib

from verl_patches.core.record import Patch, PatchDefinitionError
from verl_patches.core.features import FEATURES


def load_registry(modules: tuple[str, ...]) -> list[Patch]:
    """The patch records of ``modules`` (each defines ``PATCHES``), in their order; ids must be unique."""
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
    check_catalogue(out)
    return out


def check_catalogue(patches: list[Patch]) -> None:
    """What no single record can check: features exist, ``requires`` and ``after`` name earlier
    records, a required record applies wherever its requirer does (same process, earlier), and
    the records that wrap one upstream object are in a declared order."""
    problems = []
    position = {p.id: i for i, p in enumerate(patches)}
    by_id = {p.id: p for p in patches}
    for i, p in enumerate(patches):
        if p.feature not in FEATURES:
            problems.append(f"patch {p.id!r}: feature {p.feature!r} is not one of {sorted(FEATURES)} "
                            "(verl_patches/core/features.py)")
        for key in ("requires", "after"):
            for dep in getattr(p, key):
                if dep not in position:
                    problems.append(f"patch {p.id!r}: {key} names {dep!r}, which is no patch")
                elif position[dep] > i:
                    problems.append(f"patch {p.id!r}: {key} names {dep!r}, which comes later in the catalogue; "
                                    "move one of them (verl_patches/patches/__init__.py)")
        for dep in p.requires:
            q = by_id.get(dep)
            if q is None:
                continue
            phases = set(p.phases) - set(q.phases)
            if phases:
                problems.append(f"patch {p.id!r} requires {dep!r}, which is not applied in {sorted(phases)}")
            if q.platforms is not None and (p.platforms is None or set(p.platforms) - set(q.platforms)):
                problems.append(f"patch {p.id!r} requires {dep!r}, which applies only on {list(q.platforms)}")
    earlier: dict[str, list[Patch]] = {}
    for p in patches:
        for q in earlier.get(p.target, []):
            if q.platforms is not None and p.platforms is not None and not set(q.platforms) & set(p.platforms):
                continue  # never in one process: each applies on its own accelerators only
            if q.id not in p.requires + p.after:
                problems.append(f"patches {q.id!r} and {p.id!r} both wrap {p.target}: {p.id!r} must list "
                                f"{q.id!r} in after= (or requires=) to declare the wrapping order")
        earlier.setdefault(p.target, []).append(p)
    if problems:
        raise PatchDefinitionError("the patch catalogue is inconsistent:\n  " + "\n  ".join(problems))


def find_patch(patches: list[Patch], patch_id: str) -> Patch:
    """The record ``patch_id`` of ``patches``; KeyError naming the command that lists them."""
    for p in patches:
        if p.id == patch_id:
            return p
    raise KeyError(f"no patch with id {patch_id!r} (see `python -m verl_patches patches`)")
