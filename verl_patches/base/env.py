"""The one typed reader of the overlay's environment variables (``VERL_PATCHES_*``).

``VARIABLES`` is the table of every such variable the overlay or its scripts read: name, type,
allowed range or choices, default, what reads it and what it does. ``get(name)`` parses and checks
the value where it is read; a value that is not of the type, outside the range, or one that
would weaken a check (a timeout of 0, an endless one) raises ``EnvError`` naming the variable,
the value and what is allowed. Unset or empty means the default.
``python -m verl_patches doctor`` reports every variable of the table that is set, with its
validity (``settings``; verl_patches/core/doctor.py ``env_findings``); nothing when none is set.
This module imports nothing of the overlay: every reader can use it.

Numbers are read as Python reads them, but only finite ones: ``nan`` and ``inf`` are refused.
Booleans are one of 1/0, true/false, yes/no, on/off (any case).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvError(ValueError):
    """An environment variable holds a value its reader cannot use; the message names it."""


@dataclass(frozen=True)
class Var:
    name: str
    kind: str  # float | int | bool | choice | list | path | json | text
    default: Any
    doc: str
    read_by: str
    low: float | None = None  # inclusive bounds for float / int
    high: float | None = None
    choices: tuple[str, ...] = ()
    weakens_below: float | None = None  # values <= this would switch a check off: refused with this reason
    weakens_why: str = ""
    # An allowed value (not the default) that still switches a check or a fix off: the doctor's line and the
    # launchers' dry run and bring-up say so (WEAKENS: ...); the run goes on, as the user asked.
    weakens_when_set: str = ""

    def weakens(self, value: Any) -> str | None:
        """The sentence for a value that switches a check or a fix off; None for any other value."""
        return self.weakens_when_set if self.weakens_when_set and value and value != self.default else None

    def allowed(self) -> str:
        if self.kind in ("float", "int"):
            lo = "" if self.low is None else f">= {self.low:g}"
            hi = "" if self.high is None else f"<= {self.high:g}"
            return f"a finite {'number' if self.kind == 'float' else 'whole number'} " + " and ".join(x for x in (lo, hi) if x)
        if self.kind == "bool":
            return f"one of {', '.join(_TRUE + _FALSE)}"
        if self.kind == "choice":
            return f"one of {', '.join(self.choices)}"
        if self.kind == "list":
            return "a comma-separated list of names"
        if self.kind == "json":
            return "a JSON object"
        if self.kind == "text":
            return "text"
        return "a path"


VARIABLES: tuple[Var, ...] = (
    Var("VERL_PATCHES_REWARD_TIMEOUT_S", "float", 3.0,
        "seconds one answer-equivalence check of the rule reward may take; an overrun scores 0",
        "verl_patches/reward/deepscaler.py", low=0.01, high=3600.0, weakens_below=0.0,
        weakens_why="a timeout of 0 or less would score every answer that needs math-verify 0.0"),
    Var("VERL_PATCHES_HEARTBEAT_TIMEOUT_S", "float", 120.0,
        "seconds a local rank of the preflight (run_distributed) may go without a heartbeat before it is named "
        "as stopped and the run ends", "verl_patches/launch/local_ranks.py", low=1.0, high=86400.0, weakens_below=0.0,
        weakens_why="a heartbeat timeout of 0 or less would switch the liveness check of the ranks off"),
    Var("VERL_PATCHES_RANK_START", "choice", "spawn",
        "how run_distributed starts its gloo ranks: spawn (a fresh interpreter each) or forkserver (forked from "
        "one server that imported VERL_PATCHES_RANK_PRELOAD once); device ranks always spawn", "verl_patches/launch/local_ranks.py",
        choices=("spawn", "forkserver")),
    Var("VERL_PATCHES_RANK_PRELOAD", "list", ("torch",),
        "modules the forkserver of run_distributed imports once, before it forks any rank",
        "verl_patches/launch/rank_preload.py"),
    Var("VERL_PATCHES_OFFLOAD_HOST_RESERVE_GB", "float", None,
        "host memory (GB) the offload pool leaves free (default: min(4 GiB, 5% of the host))",
        "verl_patches/offload/pool.py", low=0.0, high=1 << 20),
    Var("VERL_PATCHES_DEVICE", "choice", "",
        "forces the accelerator (default: the first of npu, cuda, cpu available)",
        "verl_patches/base/accelerator.py", choices=("npu", "cuda", "cpu")),
    Var("VERL_PATCHES_PLATFORM", "choice", "",
        "npu-rehearsal: the NPU rehearsal platform, a declared stand-in: the torch_npu (and torchair) stand-in "
        "packages map the NPU device API onto the host and answer torch_npu's operators and MindSpeed's kernels "
        "with host implementations; refused where a real torch_npu imports. Default: no stand-in",
        "verl_patches/rigs/npu_rehearsal/__init__.py", choices=("npu-rehearsal",)),
    Var("VERL_PATCHES_PHASE", "choice", "",
        "forces the process phase the prelude applies patches for (default: detected)",
        "verl_patches/core/phase.py", choices=("driver", "worker", "engine_core")),
    Var("VERL_PATCHES_OFF", "bool", False, "true: the prelude applies no patch at all",
        "verl_patches/prelude.py",
        weakens_when_set="no patch is applied: every fix and check of the overlay is off (upstream's behaviour)"),
    Var("VERL_PATCHES_DISABLE", "list", (), "patch ids the prelude leaves out (bisecting)",
        "verl_patches/prelude.py", weakens_when_set="the named patches, and the checks they carry, are off"),
    Var("VERL_PATCHES_EXTRA_MODULES", "list", (), "extra patch catalogue modules (a site's own patches)",
        "verl_patches/patches/__init__.py"),
    Var("VERL_PATCHES_LOCK", "path", None, "the upstream lock file (default: configs/upstream.lock.toml)",
        "verl_patches/core/lock.py"),
    Var("VERL_PATCHES_FIXED_ROUTING", "bool", False,
        "balanced fixed MoE routing in the rollout (exported from recipe.fixed_routing)",
        "verl_patches/train/fixed_routing.py"),
    Var("VERL_PATCHES_DP_SYNC_ON_DEVICE", "bool", True,
        "vLLM's DP-group agreement on the device (exported from recipe.dp_sync_on_device)",
        "verl_patches/rollout/dp_sync.py"),
    Var("VERL_PATCHES_VLLM_DP_DOMAIN", "json", None,
        "the vLLM DP domain description (exported by the rollout patch from recipe.vllm_dp)",
        "verl_patches/rollout/dp_domain.py"),
    Var("VERL_PATCHES_STABLE_MEMORY", "choice", "auto",
        "the address-stable allocator for graph mode (auto picks per accelerator; none turns it off)",
        "verl_patches/offload/stable.py",
        choices=("auto", "torch_memory_saver", "vllm_cumem", "vllm_ascend_camem", "none")),
    Var("VERL_PATCHES_RESHARD_TRITON", "bool", True, "false: the reshard copies with torch, not its Triton kernel",
        "verl_patches/reshard/copyops.py"),
    Var("VERL_PATCHES_FINGERPRINT_TRITON", "bool", True,
        "false: the weight fingerprint sums with torch on CUDA too, not its fused Triton kernel",
        "verl_patches/reshard/checksum.py"),
    Var("VERL_PATCHES_CACHE", "path", None, "where the test environment setup keeps its downloads",
        "scripts/setup_test_env.sh"),
    Var("VERL_PATCHES_VENV_LOCK_WAIT_S", "int", 1800, "seconds a build of the test environment waits for another "
        "build of the same venv to finish before it is refused", "scripts/setup_test_env.sh", low=1, high=86400),
    Var("VERL_PATCHES_UPSTREAM_DIR", "path", None, "the folder with upstream release archives (MindSpeed, "
        "MindSpeed-LLM, Megatron-LM's training package)", "scripts/install_upstream_sources.sh, scripts/setup_test_env.sh"),
    Var("VERL_PATCHES_INJECT_FAULT", "text", "",
        "TESTS ONLY: corrupt rollout weights after a named step's reshard, so the weight fingerprint must stop "
        "the run there (e.g. flip,step=3,rank=1); never set in production", "verl_patches/reshard/faults.py",
        weakens_when_set="rollout weights are corrupted on purpose (a test of the fingerprint check); never in "
                         "production: the cluster launchers refuse it"),
)
BY_NAME = {v.name: v for v in VARIABLES}
PREFIX = "VERL_PATCHES_"


def parse(var: Var, raw: str) -> Any:
    """The value of ``raw`` for ``var``; EnvError naming the variable when it is not allowed."""
    text = raw.strip()
    if not text:
        return var.default
    bad = f"{var.name}={raw!r}: expected {var.allowed()}"
    if var.kind in ("float", "int"):
        try:
            value: Any = int(text) if var.kind == "int" else float(text)
        except ValueError:
            raise EnvError(bad) from None
        if not math.isfinite(value):
            raise EnvError(bad)
        if var.weakens_below is not None and value <= var.weakens_below:
            raise EnvError(f"{bad}; refused: {var.weakens_why}")
        if (var.low is not None and value < var.low) or (var.high is not None and value > var.high):
            raise EnvError(bad)
        return value
    if var.kind == "bool":
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise EnvError(bad)
    if var.kind == "choice":
        if text.lower() not in var.choices:
            raise EnvError(bad)
        return text.lower()
    if var.kind == "list":
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        if any(any(c.isspace() or c == "\0" for c in x) for x in items):
            raise EnvError(f"{bad} (an item holds a space)")
        return items
    if var.kind == "json":
        try:
            value = json.loads(text)
        except ValueError as e:
            raise EnvError(f"{bad} ({e})") from None
        if not isinstance(value, dict):
            raise EnvError(bad)
        return value
    if "\0" in text:
        raise EnvError(bad)
    return text


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The checked value of the overlay's variable ``name`` (its default when unset or empty)."""
    var = BY_NAME[name]
    raw = (os.environ if environ is None else environ).get(name)
    return var.default if raw is None else parse(var, raw)


@dataclass(frozen=True)
class Setting:
    name: str
    raw: str
    ok: bool
    detail: str
    weakens: str | None = None  # an allowed value that switches a check or a fix off: what it switches off


def settings(environ: Mapping[str, str] | None = None) -> list[Setting]:
    """Every variable of the table that is set, with whether its value is allowed, and every other
    ``VERL_PATCHES_*`` variable that is set (nothing reads it: a misspelt name, invalid)."""
    env = os.environ if environ is None else environ
    out = [Setting(k, env[k], False, f"{k} is not a variable the overlay reads (a misspelt name?); known: "
                   + ", ".join(sorted(BY_NAME))) for k in sorted(env) if k.startswith(PREFIX) and k not in BY_NAME]
    for var in VARIABLES:
        if var.name not in env:
            continue
        raw = env[var.name]
        try:
            value = parse(var, raw)
        except EnvError as e:
            out.append(Setting(var.name, raw, False, f"{e} (read by {var.read_by})"))
            continue
        weak = var.weakens(value)
        out.append(Setting(var.name, raw, True, f"{var.name}={value!r}: {var.doc} (read by {var.read_by})"
                           + (f"; WEAKENS: {weak}" if weak else ""), weak))
    return out

