"""The declarative patch record: everything the prelude, the doctor, the diff and the docs need.

A record names its upstream target and the fingerprint of the original it was written
against; it holds no code, only the dotted path of our replacement.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Literal

from verl_patches.core.fingerprint import Fingerprint

# Processes that apply patches. verl 0.4.1's SPMD rollout runs vLLM inside the Ray worker
# (external launcher), so engine-core patches list "worker" too where that is where they run.
PHASES = ("driver", "worker", "engine_core")
KINDS = ("replace", "wrap")
# Accelerators a record may be restricted to (None on the record: all of them).
PLATFORMS = ("cpu", "cuda", "npu")


class PatchDefinitionError(ValueError):
    """A patch record is malformed (caught when the registry is loaded, not at apply time)."""


@dataclass(frozen=True)
class Patch:
    id: str
    target: str  # "package.module:Qual.name"
    kind: Literal["replace", "wrap"]
    phases: tuple[str, ...]
    upstream: str  # key of the component in configs/upstream.lock.toml
    versions: str  # PEP 440 specifier of upstream versions it was written for
    fingerprint: Fingerprint
    replacement: str  # "verl_patches.…:name": the new object (replace) or factory(original) (wrap)
    why: str
    remove_when: str
    flag: str = ""  # config key or environment variable that turns the behaviour on/off
    upstream_ref: str = ""  # issue / PR / commit that motivates or would remove it
    feature: str = ""  # the recipe feature it belongs to (verl_patches.core.features.FEATURES)
    requires: tuple[str, ...] = ()  # ids of patches that must be applied (earlier) for this one to work
    after: tuple[str, ...] = ()  # ids it must be applied after when those apply too (wrapping order)
    platforms: tuple[str, ...] | None = None  # accelerators it applies on; None: all of them
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        problems = []
        if ":" not in self.target or self.target.count(":") != 1:
            problems.append(f"target {self.target!r} must be 'module:qualname'")
        if ":" not in self.replacement:
            problems.append(f"replacement {self.replacement!r} must be 'module:name'")
        if self.kind not in KINDS:
            problems.append(f"kind {self.kind!r} not in {KINDS}")
        bad = [p for p in self.phases if p not in PHASES]
        if not self.phases or bad:
            problems.append(f"phases {self.phases!r} must be a non-empty subset of {PHASES}")
        if not self.why.strip() or not self.remove_when.strip():
            problems.append("why and remove_when are required")
        if not self.feature:
            problems.append("feature is required (one of verl_patches/core/features.py's FEATURES)")
        if self.platforms is not None:
            wrong = [x for x in self.platforms if x not in PLATFORMS]
            if not self.platforms or wrong or not isinstance(self.platforms, tuple):
                problems.append(f"platforms {self.platforms!r} must be None or a non-empty tuple from {PLATFORMS}")
        for key in ("requires", "after"):
            ids = getattr(self, key)
            if not isinstance(ids, tuple) or self.id in ids or not all(isinstance(i, str) for i in ids):
                problems.append(f"{key} {ids!r} must be a tuple of other patch ids")
        if problems:
            raise PatchDefinitionError(f"patch {self.id!r}: " + "; ".join(problems))

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]

    def applies_on(self, device_type: str) -> bool:
        return self.platforms is None or device_type in self.platforms

    def load_replacement(self) -> Any:
        mod, _, name = self.replacement.partition(":")
        obj: Any = importlib.import_module(mod)
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj
