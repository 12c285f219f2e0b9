"""The classes a Megatron layer spec resolves to, each with the upstream release it came from, and what is wrong
with any of them.

On Ascend the training model is built from MindSpeed-LLM's DeepSeek layer spec
(verl_patches/patches/verl/patch_models_mcore_model_initializer.py). Under an older MindSpeed some of the classes
such a spec names were bare ``torch.nn.Module`` dummies (issue 35's reproduction: MindSpeed 2.1.0 registered
Transformer Engine's classes that way), and a dummy builds without an error. So the spec is walked when it is
used, and the build refuses a spec that resolves to:

1. ``None``;
2. ``torch.nn.Module`` itself (the shape of a dummy);
3. a class of Transformer Engine (there is none on an NPU: anything under that name is a stand-in);
4. a class of the CPU platform's host modules (``verl_patches.rigs.cpu``: a parallel path beside the NPU's).

Each entry names its package and that package's release in configs/upstream.lock.toml, so a run's log says which
MindSpeed / MindSpeed-LLM / megatron-core code it trains with. Walking is duck-typed (a spec has ``module`` and
``submodules``; submodules are a dataclass or a mapping), so this module imports no upstream package.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Iterator

from verl_patches.core.lock import load_lock


class LayerSpecError(RuntimeError):
    """A layer spec resolves to a dummy, None or a foreign platform's class (the message names each)."""


# Top-level package -> lock component (for the release); the components whose classes a DeepSeek spec holds.
PACKAGES = {"mindspeed_llm": "mindspeed_llm", "mindspeed": "mindspeed", "megatron": "megatron_core",
            "torch": "torch", "verl_patches": None}


@dataclasses.dataclass(frozen=True)
class Resolved:
    path: str  # where in the spec: layer.self_attention.submodules.core_attention, ...
    obj: Any  # the class (or function) the spec names there

    @property
    def name(self) -> str:
        return "None" if self.obj is None else f"{getattr(self.obj, '__module__', '?')}.{getattr(self.obj, '__qualname__', repr(self.obj))}"

    @property
    def package(self) -> str:
        return (getattr(self.obj, "__module__", "") or "").split(".")[0]


def _is_spec(x: Any) -> bool:
    return hasattr(x, "module") and hasattr(x, "submodules") and not inspect.isclass(x)


def _children(submodules: Any) -> Iterator[tuple[str, Any]]:
    if submodules is None:
        return
    if isinstance(submodules, dict):
        yield from submodules.items()
    elif dataclasses.is_dataclass(submodules):
        for f in dataclasses.fields(submodules):
            yield f.name, getattr(submodules, f.name)
    else:
        yield "", submodules


def walk(spec: Any, path: str = "layer") -> list[Resolved]:
    """Every class a spec names, depth first: the spec's own module, then each submodule (a spec, a class, a
    function such as a bias-dropout-add factory, or None where the spec leaves a slot empty on purpose: those
    slots are skipped, a ModuleSpec whose module is None is not)."""
    out: list[Resolved] = []
    if _is_spec(spec):
        out.append(Resolved(path, spec.module))
        for name, child in _children(spec.submodules):
            if child is None or not (_is_spec(child) or callable(child)):
                continue  # an empty slot or a setting (a number, a key map), not a class
            out += walk(child, f"{path}.{name}" if name else path)
    elif spec is not None:
        out.append(Resolved(path, spec))
    return out


def problems(entries: list[Resolved]) -> list[str]:
    """What makes each entry unusable on the NPU path (empty: every class is a real implementation)."""
    import torch  # at call time: the doctor reads the catalogue (and this module) in a Python without torch

    bad = []
    for e in entries:
        if e.obj is None:
            bad.append(f"{e.path}: resolves to None")
        elif e.obj is torch.nn.Module:
            bad.append(f"{e.path}: resolves to torch.nn.Module itself (a dummy: nothing implements it)")
        elif e.package == "transformer_engine":
            bad.append(f"{e.path}: {e.name} is Transformer Engine's, which an NPU does not have (a stand-in)")
        elif e.name.startswith("verl_patches.rigs.cpu."):
            bad.append(f"{e.path}: {e.name} is the CPU platform's host module, not the NPU path's")
    return bad


def releases() -> dict[str, str]:
    """Package -> "<component> <ref> (<commit>)" from the lock, for the packages a spec's classes come from."""
    lock = load_lock()
    out = {}
    for package, key in PACKAGES.items():
        comp = lock.get(key) if key else None
        if key is None:
            out[package] = "this overlay"
        elif comp is None:
            out[package] = f"{key} (not in the lock)"
        else:
            out[package] = f"{key} {comp.ref}" + (f" ({comp.commit[:12]})" if comp.commit else "")
    return out


def report(entries: list[Resolved]) -> list[str]:
    """One line per entry: path, class, release."""
    rel = releases()
    return [f"{e.path}: {e.name} [{rel.get(e.package, e.package or '?')}]" for e in entries]


def check(spec: Any, what: str) -> list[Resolved]:
    """walk + problems; raises LayerSpecError naming every problem (fail closed: a dummy builds silently)."""
    entries = walk(spec)
    bad = problems(entries)
    if bad:
        raise LayerSpecError(f"{what} resolves to classes that do not implement the NPU path:\n  " + "\n  ".join(bad)
                             + "\nInstall the MindSpeed / MindSpeed-LLM releases of configs/upstream.lock.toml "
                               "(scripts/install_upstream_sources.sh) and check `python -m verl_patches doctor`")
    return entries
