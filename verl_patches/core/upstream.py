"""Find upstream packages' source files and versions without importing them.

Two layouts are supported: packages installed in site-packages (version from their
distribution metadata) and packages copied next to the overlay, or given with
``--upstream-root`` (version read from the source tree itself where it records one).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Located:
    import_name: str
    path: Path | None  # package directory (or module file); None when not found
    version: str | None  # None when the tree records no version
    origin: str  # "installed", "source tree", or "not found"


def _top_dirs(top: str, root: Path | None) -> list[Path]:
    if root is not None:
        cand = Path(root) / top
        return [cand] if cand.exists() or cand.with_suffix(".py").exists() else []
    # find_spec on a top-level name imports nothing (there is no parent to import).
    spec = importlib.util.find_spec(top) if top not in sys.modules else sys.modules[top].__spec__
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [Path(p) for p in spec.submodule_search_locations]
    return [Path(spec.origin).parent] if spec.origin else []


def module_file(module: str, root: Path | None = None) -> Path | None:
    """The .py file that ``import module`` would load, found by walking directories."""
    top, *rest = module.split(".")
    for base in _top_dirs(top, root):
        if base.suffix == ".py":  # a top-level single-file module
            return base if not rest else None
        path = base
        for part in rest:
            path = path / part
        for cand in (path.with_suffix(".py"), path / "__init__.py"):
            if cand.is_file():
                return cand
    return None


def _package_dir(import_name: str, root: Path | None) -> Path | None:
    top, *rest = import_name.split(".")
    for base in _top_dirs(top, root):
        path = base.joinpath(*rest)
        if path.is_dir() or path.with_suffix(".py").is_file():
            return path
    return None


def _assigned_strings(path: Path, names: tuple[str, ...]) -> dict[str, object]:
    out: dict[str, object] = {}
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return out
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
            for t in stmt.targets:
                if isinstance(t, ast.Name) and t.id in names:
                    out[t.id] = stmt.value.value
    return out


def _source_tree_version(import_name: str, pkg: Path) -> str | None:
    """Versions as the upstream trees record them in their own sources."""
    top = import_name.split(".")[0]
    if top == "verl" and (pkg / "version" / "version").is_file():
        return (pkg / "version" / "version").read_text().strip()
    if import_name == "megatron.core" and (pkg / "package_info.py").is_file():
        v = _assigned_strings(pkg / "package_info.py", ("MAJOR", "MINOR", "PATCH"))
        if len(v) == 3:
            return f"{v['MAJOR']}.{v['MINOR']}.{v['PATCH']}"
    for name in ("_version.py", "version.py"):
        f = pkg / name
        if f.is_file():
            v = _assigned_strings(f, ("__version__", "version"))
            if v:
                return str(v.get("__version__", v.get("version")))
    return None


def locate(import_name: str, dist_name: str | None, root: Path | None = None) -> Located:
    pkg = _package_dir(import_name, root)
    if pkg is None:
        return Located(import_name, None, None, "not found")
    if dist_name is not None and root is None:
        try:
            dist = md.distribution(dist_name)
        except md.PackageNotFoundError:
            dist = None
        if dist is not None:
            # The distribution counts only if it owns the tree that would be imported;
            # a copied-in tree earlier on sys.path shadows an installed one.
            owned = Path(str(dist.locate_file(import_name.replace(".", "/")))).resolve()
            if owned == pkg.resolve():
                return Located(import_name, pkg, dist.version, "installed")
    return Located(import_name, pkg, _source_tree_version(import_name, pkg), "source tree")
