"""The NPU rehearsal platform's state: selection, the stand-in site, which torch_npu is in use, the operator
tables (a leaf: verl_patches.rigs.npu_rehearsal and its op-builder records both read it)."""


from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from verl_patches.base import env

PACKAGE = "verl_patches.rigs.npu_rehearsal"
PLATFORM = "npu-rehearsal"
ENV = "VERL_PATCHES_PLATFORM"
SITE = Path(__file__).resolve().parent / "site"
STAND_INS = ("torch_npu", "torchair", "acl")


class RehearsalError(RuntimeError):
    """The NPU rehearsal platform cannot be used as asked; the message names the fix."""


def selected(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``VERL_PATCHES_PLATFORM=npu-rehearsal`` is set (checked by the overlay's env reader)."""
    return env.get(ENV, environ) == PLATFORM


def _is_stand_in(origin: str | None) -> bool:
    return origin is not None and Path(origin).resolve().is_relative_to(SITE)


def real_torch_npu_origin() -> str | None:
    """Where a real torch_npu would be imported from (the stand-in's site excluded), None where there is none."""
    mod = sys.modules.get("torch_npu")
    if mod is not None and not _is_stand_in(getattr(mod, "__file__", None)):
        return str(getattr(mod, "__file__", "<torch_npu in sys.modules>"))
    path = [p for p in sys.path if not (p and Path(p).resolve() == SITE)]
    spec = importlib.machinery.PathFinder.find_spec("torch_npu", path)
    return None if spec is None else str(spec.origin)


def active() -> bool:
    """True when the imported torch_npu is this stand-in."""
    mod = sys.modules.get("torch_npu")
    return mod is not None and _is_stand_in(getattr(mod, "__file__", None))


def activate() -> Any:
    """Put the stand-in packages first on ``sys.path`` and import the torch_npu stand-in (which registers
    ``torch.npu``); returns it. Only when the platform is selected and no real torch_npu is installed."""
    if not selected():
        raise RehearsalError(f"the NPU rehearsal platform is not selected: set {ENV}={PLATFORM} to use the "
                             "torch_npu stand-in (it is never used otherwise)")

    forced = env.get("VERL_PATCHES_DEVICE")
    if forced and forced != "npu":
        # The overlay would take the host's records and skip MindSpeed-LLM's adaptor: a CPU run under the
        # rehearsal's name. (Found in CI: a test's in-process preflight left VERL_PATCHES_DEVICE=cpu behind.)
        raise RehearsalError(f"VERL_PATCHES_DEVICE={forced} contradicts {ENV}={PLATFORM} (the stand-in is an NPU): "
                             f"unset VERL_PATCHES_DEVICE, or unset {ENV} for a {forced} run")
    real = real_torch_npu_origin()
    if real is not None:
        raise RehearsalError(f"a real torch_npu is installed ({real}); the NPU rehearsal platform's stand-in "
                             f"({SITE / 'torch_npu'}) is never used beside it: unset {ENV} to run on the NPU")
    site = str(SITE)
    if site not in sys.path:
        sys.path.insert(0, site)
    mod = importlib.import_module("torch_npu")
    if not _is_stand_in(getattr(mod, "__file__", None)):
        raise RehearsalError(f"torch_npu was imported from {mod.__file__}, not the stand-in at {SITE}")
    return mod


def describe() -> str:
    """Which torch_npu is in use (or would be), for the doctor and the run's banner."""
    if active():
        return (f"torch_npu: STAND-IN of the NPU rehearsal platform ({ENV}={PLATFORM}; host device, host "
                f"operators) from {SITE / 'torch_npu'}")
    real = real_torch_npu_origin()
    if real is not None:
        mod = sys.modules.get("torch_npu")
        version = getattr(mod, "__version__", "not imported yet") if mod is not None else "not imported yet"
        return f"torch_npu: real ({version}) from {real}"
    if selected():
        return f"torch_npu: STAND-IN selected ({ENV}={PLATFORM}), not yet activated"
    return "torch_npu: none (not installed; the NPU rehearsal platform is not selected)"


# The package whose tables the stand-in answers from (ops/__init__.py assembles them from its modules). It imports
# torch, so it is imported when a table is first read, not here: this module is read by the doctor without torch.
OPS = f"{PACKAGE}.ops"


def _tables() -> tuple[dict[str, Callable[..., Any]], dict[str, dict[str, Callable[..., Any]]]]:
    try:
        mod = importlib.import_module(OPS)
    except ModuleNotFoundError as e:
        if e.name != OPS:
            raise
        raise RehearsalError(f"the NPU rehearsal platform's operator tables ({OPS}) are missing: the stand-in has "
                             "no operator to answer with (a broken install?)") from e
    return mod.OPERATORS, mod.MINDSPEED_KERNELS


def operators() -> Mapping[str, Callable[..., Any]]:
    """torch_npu attribute name -> host implementation (``OPERATORS`` of the ops package), read at each call so
    that an operator removed from the table is missing at once."""
    return MappingProxyType(_tables()[0])


def mindspeed_kernels() -> Mapping[str, Mapping[str, Callable[..., Any]]]:
    """MindSpeed op-builder NAME -> {function name -> host implementation}."""
    return MappingProxyType(_tables()[1])


def missing_operator(qualified: str) -> AttributeError:
    """The error for a torch_npu name the stand-in does not implement."""
    return AttributeError(f"{qualified} is not implemented by the torch_npu stand-in of the NPU rehearsal platform "
                          f"({ENV}={PLATFORM}); add a host implementation with torch_npu's documented signature and "
                          f"a reference test to verl_patches/rigs/npu_rehearsal/ops/ (listed in OPERATORS of its "
                          f"__init__.py), or a device-API name to the stand-in package ({SITE})")
