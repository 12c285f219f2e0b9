"""Apply and undo patch records on live upstream modules: strict, idempotent, reversible.

Strict: a missing target, a fingerprint that differs from the record, or an upstream
version outside the record's range raises PatchError naming the patch, the target and the
installed version; a missing attribute is never created. Idempotent: the patched object
carries the patch id, so applying again (or in a forked child, which inherits the patched
modules) changes nothing. Aliases bound by ``from module import f`` in modules imported
earlier are rebound too, and everything is recorded so ``undo`` restores it exactly.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from verl_patches.core.fingerprint import TargetNotFound, fingerprint_file
from verl_patches.core.lock import load_lock
from verl_patches.core.record import Patch
from verl_patches.core.upstream import locate

MARK = "__verl_patch_id__"
ORIGINAL = "__verl_patch_original__"


class PatchError(RuntimeError):
    """A patch cannot be applied to the installed upstream; the message says why."""


@dataclass
class Applied:
    patch: Patch
    owner: Any  # module or class holding the target attribute
    attr: str
    original: Any  # raw attribute as found in owner.__dict__ (keeps staticmethod etc.)
    new: Any
    aliases: list[tuple[types.ModuleType, str]] = field(default_factory=list)


# id -> Applied, in application order. Module state, so a forked child inherits it.
_APPLIED: dict[str, Applied] = {}


def applied() -> dict[str, Applied]:
    return dict(_APPLIED)


def installed_version(patch: Patch) -> str:
    comp = load_lock().get(patch.upstream)
    import_name = comp.import_name if comp and comp.import_name else patch.module.split(".")[0]
    loc = locate(import_name, comp.package if comp else None)
    return loc.version or f"unknown ({loc.origin})"


def _error(patch: Patch, what: str) -> PatchError:
    return PatchError(f"patch {patch.id!r} on {patch.target} "
                      f"({patch.upstream} {installed_version(patch)} installed): {what}")


def _version_ok(patch: Patch) -> tuple[bool, str]:
    v = installed_version(patch)
    if v.startswith("unknown"):
        return True, v  # a source tree without a version: the fingerprint decides
    try:
        return Version(v) in SpecifierSet(patch.versions), v
    except InvalidVersion:
        return False, v


def _resolve_owner(patch: Patch) -> tuple[Any, str]:
    try:
        module = importlib.import_module(patch.module)
    except ImportError as e:
        raise _error(patch, f"module {patch.module} cannot be imported: {e}") from e
    # The hook line at the end of verl's worker module runs while that module is still
    # initialising: its classes exist by then. Only a name not yet defined is a problem.
    initialising = getattr(getattr(module, "__spec__", None), "_initializing", False)
    hint = (f" (module {patch.module} is still being imported: put `from verl_patches import "
            "prelude_patch` at the end of it, not the top)") if initialising else ""
    *outer, attr = patch.qualname.split(".")
    owner: Any = module
    for part in outer:
        if part not in vars(owner):
            raise _error(patch, f"{part!r} does not exist in {getattr(owner, '__name__', owner)}{hint}")
        owner = vars(owner)[part]
    if attr not in vars(owner):
        raise _error(patch, f"attribute {attr!r} does not exist (never created by the overlay){hint}")
    return owner, attr


def _check_fingerprint(patch: Patch, owner: Any) -> None:
    module = sys.modules[patch.module]
    path = Path(getattr(module, "__file__", "") or "")
    if not path.is_file():
        raise _error(patch, f"source of {patch.module} not found, cannot check the fingerprint")
    try:
        fp = fingerprint_file(path, patch.qualname)
    except TargetNotFound as e:
        raise _error(patch, f"not found in {path}: {e}") from e
    if fp != patch.fingerprint:
        raise _error(patch, f"upstream changed: expected {patch.fingerprint}, found {fp} in {path}")


def _chain_ids(func: Any) -> set[str]:
    """Ids of every patch layered on a target: the outermost mark, then each original under it."""
    ids: set[str] = set()
    while func is not None and getattr(func, MARK, None) is not None:
        ids.add(getattr(func, MARK))
        func = getattr(func, ORIGINAL, None)
    return ids


def _unwrap_descriptor(raw: Any) -> Any:
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


def _rewrap_descriptor(raw: Any, func: Any) -> Any:
    if isinstance(raw, staticmethod):
        return staticmethod(func)
    if isinstance(raw, classmethod):
        return classmethod(func)
    return func


def _rebind_aliases(original: Any, new: Any, skip: Any) -> list[tuple[types.ModuleType, str]]:
    rebound = []
    for mod in list(sys.modules.values()):
        if mod is None or mod is skip or not isinstance(mod, types.ModuleType):
            continue
        d = getattr(mod, "__dict__", None)
        if not d:
            continue
        for name, value in list(d.items()):
            if value is original:
                setattr(mod, name, new)
                rebound.append((mod, name))
    return rebound


def _check_order(patch: Patch) -> None:
    """``requires``: applied before, in this process. ``after``: no patch that must wrap outside
    this one is in place yet (else this wrapper would end up outside it)."""
    missing = [dep for dep in patch.requires if dep not in _APPLIED]
    if missing:
        raise _error(patch, f"requires {missing}, not applied in this process (disabled, skipped or failed); "
                            f"apply them first, or disable {patch.id!r} too")
    outer = [q.patch.id for q in _APPLIED.values() if patch.id in q.patch.after]
    if outer:
        raise _error(patch, f"must be applied before {outer} (their after= lists it): apply in catalogue order")


def _reached_through_subclass(patch: Patch) -> bool:
    """True when ``patch`` was applied earlier in this process to a class that the target's name no longer
    holds, but the class now there inherits the patched attribute (MindSpeed's patches manager puts subclasses
    in the place of megatron's classes, e.g. its swap optimizer for DistributedOptimizer): the patch still
    reaches the code that runs. A class there that overrides the attribute is an error naming it."""
    rec = _APPLIED.get(patch.id)
    if rec is None or not inspect.isclass(rec.owner) or vars(rec.owner).get(rec.attr) is not rec.new:
        return False
    *outer, attr = patch.qualname.split(".")
    owner: Any = importlib.import_module(patch.module)
    for part in outer:
        owner = getattr(owner, part, None)
    if owner is rec.owner or not (inspect.isclass(owner) and issubclass(owner, rec.owner)):
        return False
    found = inspect.getattr_static(owner, attr, None)
    if patch.id in _chain_ids(_unwrap_descriptor(found)):
        return True
    definer = next((c for c in owner.__mro__ if attr in vars(c)), None)
    raise _error(patch, f"applied to {rec.owner.__module__}.{rec.owner.__qualname__}.{attr}, but "
                        f"{patch.module}.{'.'.join(outer)} is now {owner.__module__}.{owner.__qualname__}, whose "
                        f"{attr} comes from {getattr(definer, '__qualname__', definer)} and is not the patched one: "
                        "the patch no longer reaches the code that runs; patch that class too")


def apply_one(patch: Patch) -> bool:
    """Apply one patch; return False if it was already in place (no change)."""
    if _reached_through_subclass(patch):
        return False
    owner, attr = _resolve_owner(patch)
    raw = vars(owner)[attr]
    if patch.id in _chain_ids(_unwrap_descriptor(raw)):
        return False  # already applied (maybe under another patch's wrapper), here or in a forked parent
    _check_order(patch)
    ok, v = _version_ok(patch)
    if not ok:
        raise _error(patch, f"version {v} is outside the supported range {patch.versions!r}")
    _check_fingerprint(patch, owner)

    original_func = _unwrap_descriptor(raw)
    replacement = patch.load_replacement()
    func = replacement(original_func) if patch.kind == "wrap" else replacement
    if isinstance(func, (staticmethod, classmethod)):
        func = func.__func__
    if not callable(func) and not inspect.isclass(func):
        raise _error(patch, f"replacement {patch.replacement} did not give a callable")
    # functools.wraps copies the wrapped function's __dict__, so a wrapper of an already
    # patched target inherits that patch's mark: that one is not a conflict.
    if getattr(func, MARK, None) not in (None, patch.id, getattr(original_func, MARK, None)):
        raise _error(patch, f"replacement is already bound to patch {getattr(func, MARK)!r}")
    try:
        setattr(func, MARK, patch.id)
        setattr(func, ORIGINAL, original_func)
    except (AttributeError, TypeError) as e:
        raise _error(patch, f"cannot mark the replacement: {e}") from e
    new = _rewrap_descriptor(raw, func)
    setattr(owner, attr, new)
    aliases: list[tuple[types.ModuleType, str]] = []
    if isinstance(owner, types.ModuleType):
        aliases = _rebind_aliases(raw, new, skip=owner)
    _APPLIED[patch.id] = Applied(patch, owner, attr, raw, new, aliases)
    return True


def apply_all(patches: Iterable[Patch]) -> list[str]:
    """Apply in order; on an error undo what this call applied, then raise."""
    done: list[str] = []
    try:
        for p in patches:
            if apply_one(p):
                done.append(p.id)
    except BaseException:
        undo(reversed(done))
        raise
    return done


def undo(ids: Iterable[str] | None = None) -> list[str]:
    """Restore the originals (all applied patches when ids is None), newest first."""
    order = list(ids) if ids is not None else list(reversed(list(_APPLIED)))
    restored = []
    for pid in order:
        rec = _APPLIED.pop(pid, None)
        if rec is None:
            continue
        if vars(rec.owner).get(rec.attr) is rec.new:
            setattr(rec.owner, rec.attr, rec.original)
        for mod, name in rec.aliases:
            if mod.__dict__.get(name) is rec.new:
                setattr(mod, name, rec.original)
        restored.append(pid)
    return restored
