"""Registry-wide: no replacement accepts fewer call shapes than the upstream function it stands in for.

For each record the original is the live upstream object (where its module imports on CPU) and the def
line of the record's fingerprint, which is the upstream signature the record was written against (the
doctor checks that the installed source still has it); where the module does not import here
(vLLM-Ascend's NPU model runner; MindSpeed when it is not installed) a stand-in with that signature is
handed to wrap factories. The replacement is what the applier would install: the replacement
itself (replace) or the factory's result for that original (wrap). The replacement's signature is
read with follow_wrapped=False: functools.wraps makes inspect.signature show upstream's parameters
even when the wrapper takes fewer, which is exactly the narrowing this test exists to catch. The
original's is read through ``__wrapped__``: verl's worker methods sit under pass-through decorators
(register, GPUMemoryLogger) whose own (*args, **kwargs) is not what the method accepts.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from typing import Any, Callable

import pytest

from verl_patches.core.apply import _unwrap_descriptor
from verl_patches.patches import load_catalogue

P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
KEYWORD = (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)


def narrowing(original: inspect.Signature, replacement: inspect.Signature) -> list[str]:
    """Calls ``original`` accepts that ``replacement`` does not (empty: it accepts every one of them)."""
    o, r = list(original.parameters.values()), list(replacement.parameters.values())
    o_pos = [p for p in o if p.kind in POSITIONAL]
    r_pos = [p for p in r if p.kind in POSITIONAL]
    r_var_pos = any(p.kind is P.VAR_POSITIONAL for p in r)
    r_var_kw = any(p.kind is P.VAR_KEYWORD for p in r)
    r_kw = {p.name: p for p in r if p.kind in KEYWORD}
    problems = []
    for i, p in enumerate(o_pos):
        if i >= len(r_pos) and not r_var_pos:
            problems.append(f"takes at most {len(r_pos)} positional argument(s); upstream takes {p.name!r} "
                            f"as positional argument {i + 1}")
            break
    if any(p.kind is P.VAR_POSITIONAL for p in o) and not r_var_pos:
        problems.append("upstream takes *args, the replacement does not")
    for p in o:
        if p.kind not in KEYWORD:
            continue
        if p.name in r_kw:
            rp = r_kw[p.name]
            if p.kind in POSITIONAL and rp.kind in POSITIONAL and o_pos.index(p) != r_pos.index(rp):
                problems.append(f"{p.name!r} is positional argument {o_pos.index(p) + 1} upstream, "
                                f"{r_pos.index(rp) + 1} in the replacement")
        elif not r_var_kw:
            problems.append(f"does not accept the keyword {p.name!r}")
    if any(p.kind is P.VAR_KEYWORD for p in o) and not r_var_kw:
        problems.append("upstream takes **kwargs, the replacement does not")
    # Nothing upstream lets a caller omit may become required.
    o_required = {p.name for p in o if p.default is P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)}
    for p in r:
        if p.default is P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD) and p.name not in o_required:
            problems.append(f"requires {p.name!r}, which upstream does not")
    return problems


def standin_from_signature(signature: str) -> Callable[..., Any]:
    """A function with the parameter shape of a fingerprint's ``def name(...)`` line (defaults and
    annotations dropped to None / nothing, which does not change the accepted call shapes)."""
    tree = ast.parse(signature.strip() + ":\n    pass\n")
    fn = tree.body[0]
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)), signature
    args = fn.args
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    fn.returns = None
    fn.decorator_list = []
    ns: dict[str, Any] = {}
    exec(compile(ast.fix_missing_locations(tree), "<fingerprint>", "exec"), ns)  # noqa: S102 - our own AST
    return ns[fn.name]


def live_original(target: str) -> Any | None:
    module, qualname = target.split(":")
    try:
        obj: Any = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means "not importable on this machine"
        return None
    for part in qualname.split("."):
        obj = vars(obj).get(part) if part in vars(obj) else getattr(obj, part, None)
        if obj is None:
            return None
    return _unwrap_descriptor(obj)


def _cases():
    return [pytest.param(p, id=p.id) for p in load_catalogue()]


def test_the_check_itself_catches_the_narrowing_that_broke_verls_default_scorer():
    upstream = inspect.signature(standin_from_signature(
        "def default_compute_score(data_source, solution_str, ground_truth, extra_info=None, "
        "sandbox_fusion_url=None, concurrent_semaphore=None, memory_limit_mb=None)"))

    def narrow(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        pass

    def wide(data_source, solution_str, ground_truth, extra_info=None, *args, **kwargs):
        pass

    def reordered(data_source, ground_truth, solution_str, extra_info=None, *args, **kwargs):
        pass

    def stricter(data_source, solution_str, ground_truth, extra_info, *args, **kwargs):
        pass

    assert any("at most 4 positional" in m for m in narrowing(upstream, inspect.signature(narrow)))
    assert narrowing(upstream, inspect.signature(wide)) == []
    assert any("positional argument 2 upstream, 3" in m for m in narrowing(upstream, inspect.signature(reordered)))
    assert narrowing(upstream, inspect.signature(stricter)) == ["requires 'extra_info', which upstream does not"]
    assert narrowing(inspect.signature(wide), upstream) == ["upstream takes *args, the replacement does not",
                                                             "upstream takes **kwargs, the replacement does not"]


def _is_pass_through(sig: inspect.Signature) -> bool:
    return [p.kind for p in sig.parameters.values()] == [P.VAR_POSITIONAL, P.VAR_KEYWORD]


@pytest.mark.parametrize("patch", _cases())
def test_no_replacement_accepts_fewer_calls_than_upstream(patch):
    # The upstream def as the record's fingerprint has it (the doctor checks the installed source still
    # says so), plus the live object's signature where it says more than a decorator's (*args, **kwargs).
    original = live_original(patch.target)
    if not patch.fingerprint.signature.startswith(("def ", "async def ")):
        # A module-level binding (megatron.core.jit's jit_fuser = ...): upstream's shape is the bound object's.
        assert original is not None and callable(original), f"{patch.id}: {patch.target} is not a callable here"
        written, uppers = original, {"live": inspect.signature(original)}
    else:
        written = standin_from_signature(patch.fingerprint.signature)
        uppers = {"fingerprint": inspect.signature(written)}
    if "live" in uppers:
        pass
    elif original is not None and callable(original):
        live = inspect.signature(original)
        if not _is_pass_through(live):
            uppers["live"] = live
    else:
        original = written
    replacement = patch.load_replacement()
    installed = _unwrap_descriptor(replacement(original) if patch.kind == "wrap" else replacement)
    ours = inspect.signature(installed, follow_wrapped=False)
    for source, upstream_sig in uppers.items():
        problems = narrowing(upstream_sig, ours)
        assert problems == [], f"{patch.id}: upstream ({source}) {upstream_sig}, installed {ours}: {problems}"
