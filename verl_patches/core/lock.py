"""The upstream lock (configs/upstream.lock.toml) as typed records.

Read with the standard library only, so the doctor runs before anything else is installed.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from verl_patches.base import env

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCK_PATH = REPO_ROOT / "configs" / "upstream.lock.toml"
CUDA_LOCK_PATH = REPO_ROOT / "configs" / "upstream.cuda.lock.toml"
# The lock a process is checked against when none is named: the launchers set it to the CUDA variant
# on NVIDIA clusters (scripts/cluster/recipe_env.sh).
LOCK_ENV = "VERL_PATCHES_LOCK"


@dataclass(frozen=True)
class Component:
    key: str
    ref: str
    repo: str | None = None
    package: str | None = None
    version: str | None = None
    import_name: str | None = None
    platforms: tuple[str, ...] = ("any",)
    install: str = ""
    sdist_sha256: str | None = None
    commit: str | None = None  # the commit the ref names, where the lock pins one
    archive: str | None = None  # file name of a release archive (sources no registry carries)
    archive_sha256: str | None = None
    optional: bool = False  # reported by the doctor but never required (an optional accelerator backend)

    def required_on(self, device_type: str) -> bool:
        return not self.optional and ("any" in self.platforms or device_type in self.platforms)


def load_lock(path: Path | None = None) -> dict[str, Component]:
    path = Path(path or env.get(LOCK_ENV) or LOCK_PATH)
    if not path.is_file():
        raise FileNotFoundError(f"upstream lock not found: {path}")
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    comps: dict[str, Component] = {}
    for key, entry in raw.get("components", {}).items():
        if "ref" not in entry:
            raise ValueError(f"{path}: component {key!r} has no 'ref'")
        platforms = entry.get("platforms", "any")
        comps[key] = Component(
            key=key,
            ref=entry["ref"],
            repo=entry.get("repo"),
            package=entry.get("package"),
            version=entry.get("version"),
            import_name=entry.get("import"),
            platforms=(platforms,) if isinstance(platforms, str) else tuple(platforms),
            install=entry.get("install", ""),
            sdist_sha256=entry.get("sdist_sha256"),
            commit=entry.get("commit"),
            archive=entry.get("archive"),
            archive_sha256=entry.get("archive_sha256"),
            optional=bool(entry.get("optional", False)),
        )
    return comps


def load_extras(path: Path | None = None) -> dict[str, dict[str, str]]:
    """The lock's optional extras: group -> {package: exact version} (``[extras.<group>]`` of the Ascend lock by
    default: the groups are the same on every accelerator). A version that is not a string is refused."""
    path = Path(path or LOCK_PATH)
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    out: dict[str, dict[str, str]] = {}
    for group, pins in raw.get("extras", {}).items():
        bad = {k: v for k, v in pins.items() if not isinstance(v, str) or not v}
        if bad:
            raise ValueError(f"{path}: [extras.{group}] pins must be version strings, got {bad}")
        out[group] = dict(pins)
    return out
