"""Fingerprints of upstream functions and classes, read from source files without importing them.

A fingerprint is the target's signature plus a hash of its normalised source (the AST
unparsed with docstrings dropped, so comments, blank lines and formatting do not count,
while any change of code does). The doctor checks upstream trees with it before anything
is imported; the applier checks the module it is about to patch with the same function.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@dataclass(frozen=True)
class Fingerprint:
    signature: str
    source_sha: str

    def __str__(self) -> str:
        return f"{self.signature} sha={self.source_sha}"


@dataclass(frozen=True)
class SourceSpan:
    """Where a target's definition lives in its file (1-based, inclusive)."""

    path: Path
    first_line: int
    last_line: int

    def text(self) -> str:
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        return "".join(lines[self.first_line - 1 : self.last_line])


class TargetNotFound(LookupError):
    """The qualified name does not exist in the parsed source."""


class SourceUnreadable(TargetNotFound):
    """The file that should hold the target is not valid Python (e.g. cut short by a full disk)."""


@functools.lru_cache(maxsize=256)
def _parse(path: str, mtime_ns: int) -> ast.Module:
    try:
        return ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError) as e:
        where = f" (line {e.lineno}: {e.msg})" if isinstance(e, SyntaxError) else f" ({e})"
        raise SourceUnreadable(f"{path} is not valid Python{where}; reinstall the package it belongs to") from None


def parse_file(path: Path) -> ast.Module:
    path = Path(path)
    return _parse(str(path), path.stat().st_mtime_ns)


def find_node(tree: ast.Module, qualname: str) -> ast.AST:
    """The def/class (or module-level assignment) named by a dotted qualname.

    The last definition wins, as at run time when a name is bound twice.
    """
    scope: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        found = None
        for stmt in scope:
            if isinstance(stmt, _DEFS) and stmt.name == part:
                found = stmt
            elif i == len(parts) - 1 and isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = stmt
        if found is None:
            where = ".".join(parts[:i]) or "<module>"
            raise TargetNotFound(f"{part!r} is not defined in {where}")
        node = found
        scope = found.body if isinstance(found, _DEFS) else []
    assert node is not None
    return node


def _strip_docstrings(node: ast.AST) -> ast.AST:
    node = copy.deepcopy(node)
    for sub in ast.walk(node):
        if isinstance(sub, (*_DEFS, ast.Module)):
            body = sub.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                sub.body = body[1:] or [ast.Pass()]
    return node


def _signature(node: ast.AST) -> str:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
        return f"{prefix} {node.name}({ast.unparse(node.args)}){ret}"
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in [*node.bases, *node.keywords])
        return f"class {node.name}({bases})"
    return ast.unparse(node).split("\n", 1)[0][:200]


def fingerprint_node(node: ast.AST) -> Fingerprint:
    normalised = ast.unparse(_strip_docstrings(node))
    return Fingerprint(_signature(node), hashlib.sha256(normalised.encode()).hexdigest()[:16])


def fingerprint_file(path: Path, qualname: str) -> Fingerprint:
    return fingerprint_node(find_node(parse_file(path), qualname))


def source_span(path: Path, qualname: str) -> SourceSpan:
    node = find_node(parse_file(path), qualname)
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return SourceSpan(Path(path), first, node.end_lineno or node.lineno)
