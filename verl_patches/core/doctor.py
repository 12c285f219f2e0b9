"""The doctor: check upstream trees against the lock and every patch against its target.

Nothing upstream is imported: versions come from distribution metadata or the source
tree, targets and fingerprints from parsing the source files. One finding per lock
component and per patch; each is ok, missing, changed or version-mismatch.

On the NPU platform one more finding, ``layer-spec``: the classes DeepSeek-V3's layer spec resolves to for a run's
config, each a real implementation with its release. That needs MindSpeed-LLM's adaptor applied and Megatron's
arguments built, which change the process for good, so it runs in a child process
(``python -m verl_patches.checks.layer_spec``, its own module's docstring says how) and this one still imports
nothing upstream.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from packaging.version import InvalidVersion, Version

from verl_patches.core.fingerprint import SourceUnreadable, TargetNotFound, fingerprint_file
from verl_patches.core.lock import Component, load_lock
from verl_patches.core.record import Patch
from verl_patches.core.upstream import locate, module_file
from verl_patches.base import env as overlay_env
from verl_patches.core.sources import source_problem
from packaging.specifiers import SpecifierSet

STATUSES = ("ok", "missing", "changed", "version-mismatch", "invalid")  # invalid: an env:VERL_PATCHES_* setting, the layer spec


@dataclass(frozen=True)
class Finding:
    id: str
    target: str
    status: str
    detail: str
    installed: str | None
    expected: str | None
    required: bool  # False: absent or different, but not needed on this platform
    # A patch whose upstream package is not installed at all: nothing to check it against. The
    # lock finding for that package reports (and under --strict fails) the absence, and on a
    # platform that needs it the prelude refuses to start without it.
    upstream_absent: bool = False

    @property
    def failed(self) -> bool:
        return self.status != "ok" and self.required and not self.upstream_absent

    def line(self) -> str:
        note = "" if self.required or self.status == "ok" else " (not required here)"
        if self.upstream_absent and self.required:
            note = " (its package is absent: see the lock line)"
        return f"{self.status:<16} {self.id:<34} {self.target}: {self.detail}{note}"


def _same_release(installed: str, expected: str) -> bool:
    try:
        # 0.9.1+empty (vLLM's pure-Python build) is release 0.9.1.
        return Version(installed).public == Version(expected).public
    except InvalidVersion:
        return installed == expected


def _cann_homes() -> list[Path]:
    env = [os.environ.get(k) for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")]
    return [Path(p) for p in env if p] + [Path("/usr/local/Ascend/ascend-toolkit/latest")]


def system_component_version(key: str) -> tuple[str, Path] | None:
    """Version of a non-Python component from its install record (CANN's toolkit info file)."""
    if key != "cann":
        return None
    for home in _cann_homes():
        for info in sorted(home.glob("*/ascend_toolkit_install.info")) + [home / "version.cfg"]:
            if info.is_file():
                for line in info.read_text(errors="replace").splitlines():
                    k, _, v = line.partition("=")
                    if k.strip() in ("version", "Version"):
                        return v.strip().strip('"'), info
    return None


# What the NPU rehearsal platform (VERL_PATCHES_PLATFORM=npu-rehearsal) stands in for: judged as stood in, not required.
REHEARSAL_STANDS_IN = ("torch_npu", "cann")


def check_component(comp: Component, platform: str, root: Path | None) -> Finding:
    required = comp.required_on(platform)
    fid = f"lock:{comp.key}"
    if platform == "npu" and comp.key in REHEARSAL_STANDS_IN:
        if overlay_env.get("VERL_PATCHES_PLATFORM") == "npu-rehearsal":  # npu_rehearsal.platform.selected()
            return Finding(fid, comp.key, "stood-in", f"{comp.key} {comp.ref or comp.version}: the NPU rehearsal "
                           "platform stands in for it (only an NPU proves it)", None, comp.ref or comp.version, False)
    if not comp.import_name:
        found = system_component_version(comp.key)
        if found is None:
            return Finding(fid, comp.key, "missing", f"{comp.key} {comp.ref}: no install record found "
                           f"(looked in {', '.join(str(p) for p in _cann_homes())})", None, comp.ref, required)
        version, where = found
        status = "ok" if version == comp.ref else "version-mismatch"
        return Finding(fid, comp.key, status, f"{version} at {where}; the lock says {comp.ref}",
                       version, comp.ref, required)
    loc = locate(comp.import_name, comp.package, root)
    if loc.path is None:
        return Finding(fid, comp.import_name, "missing", f"{comp.import_name} not found"
                       + (f" under {root}" if root else " on sys.path"), None, comp.version, required)
    if comp.version and loc.version and not _same_release(loc.version, comp.version):
        return Finding(fid, comp.import_name, "version-mismatch",
                       f"{loc.version} at {loc.path} ({loc.origin}); the lock says {comp.version}",
                       loc.version, comp.version, required)
    detail = f"{loc.version or 'version not recorded in the source tree'} at {loc.path} ({loc.origin})"
    if comp.archive and loc.origin == "installed" and comp.package:
        # A source-only release reports one version for every release (MindSpeed 0.12.1, MindSpeed-LLM
        # 0.0.1): the source its installer recorded says which one it is (verl_patches/core/sources.py).
        problem = source_problem(comp.package, comp.archive_sha256, comp.commit)
        if problem:
            return Finding(fid, comp.import_name, "version-mismatch",
                           f"{problem}; the lock's release is {comp.ref} ({comp.commit}): reinstall it with "
                           "bash scripts/install_upstream_sources.sh", loc.version, comp.ref, required)
        detail += f", from the lock's release {comp.ref}"
    return Finding(fid, comp.import_name, "ok", detail, loc.version, comp.version, required)


def check_patch(patch: Patch, lock: dict[str, Component], platform: str, root: Path | None) -> Finding:
    comp = lock.get(patch.upstream)
    if comp is None:
        # A lock for one accelerator (the CUDA variant) has no entry for another's packages; only a
        # patch that applies here needs its upstream in the lock.
        return Finding(patch.id, patch.target, "missing",
                       f"upstream {patch.upstream!r} is not in the lock", None, patch.versions,
                       patch.applies_on(platform))
    required = comp.required_on(platform) and patch.applies_on(platform)
    loc = locate(comp.import_name or patch.module.split(".")[0], comp.package, root)
    if loc.path is None:
        return Finding(patch.id, patch.target, "missing", f"{comp.import_name} is not installed",
                       None, patch.versions, required, upstream_absent=True)
    path = module_file(patch.module, root)
    if path is None:
        return Finding(patch.id, patch.target, "missing", f"module {patch.module} not found in {loc.path}",
                       loc.version, patch.versions, required)
    try:
        fp = fingerprint_file(path, patch.qualname)
    except SourceUnreadable as e:
        return Finding(patch.id, patch.target, "changed", str(e), loc.version, patch.versions, required)
    except TargetNotFound as e:
        return Finding(patch.id, patch.target, "missing", f"{e} ({path})", loc.version, patch.versions, required)
    if loc.version:
        try:
            in_range = Version(loc.version) in SpecifierSet(patch.versions)
        except InvalidVersion:
            in_range = False
        if not in_range:
            return Finding(patch.id, patch.target, "version-mismatch",
                           f"{comp.import_name} {loc.version} is outside {patch.versions!r}",
                           loc.version, patch.versions, required)
    if fp != patch.fingerprint:
        return Finding(patch.id, patch.target, "changed",
                       f"expected {patch.fingerprint}, found {fp} in {path}", loc.version, patch.versions, required)
    return Finding(patch.id, patch.target, "ok", f"fingerprint {fp.source_sha} matches ({path})",
                   loc.version, patch.versions, required)


def is_failing(f: Finding, strict: bool) -> bool:
    """Whether ``f`` makes the doctor fail: a required patch that does not match, a required
    component that is absent (nothing can run without it), and under ``strict`` any required
    component that differs from the lock (otherwise a note)."""
    if not f.failed:
        return False
    return not f.id.startswith("lock:") or strict or f.status == "missing"


def run_doctor(patches: list[Patch], platform: str, root: Path | None = None,
               strict: bool = False, lock_path: Path | None = None) -> tuple[list[Finding], int]:
    """All findings and the exit code: 1 whenever one of them is failing (``is_failing``)."""
    lock = load_lock(lock_path)
    comp_findings = [check_component(c, platform, root) for c in lock.values()]
    patch_findings = [check_patch(p, lock, platform, root) for p in patches]
    findings = comp_findings + patch_findings + install_findings()
    return findings, (1 if any(is_failing(f, strict) for f in findings) else 0)


PLUGIN_GROUPS = ("vllm.general_plugins", "vllm.platform_plugins")  # pyproject.toml's entry points


def _defines(module: str, attr: str) -> bool:
    """Whether ``module`` (found on the path, not imported) defines ``attr`` at its top level."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    tree = ast.parse(Path(spec.origin).read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return attr in names


def install_findings() -> list[Finding]:
    """One failing finding per entry point of the installed verl-patches distribution (vLLM's plugins)
    that names a function this source tree does not define: an install made before a module moved,
    whose vLLM processes would only log that the plugin failed to load and run unpatched. None when
    every entry point resolves or the package is not installed, so the doctor's output is then what
    it always was."""
    try:
        entry_points = metadata.distribution("verl-patches").entry_points
    except metadata.PackageNotFoundError:
        return []
    out = []
    for ep in entry_points:
        module, _, attr = ep.value.partition(":")
        if ep.group in PLUGIN_GROUPS and not _defines(module, attr):
            out.append(Finding(f"install:{ep.group}", ep.name, "changed",
                               f"the installed package's entry point names {ep.value}, which this source tree does not "
                               "define (installed before a module moved): reinstall it (pip install -e . in the "
                               "checkout, or bash scripts/setup_test_env.sh)", ep.value, None, True))
    return out


def env_findings(environ=None) -> list[Finding]:
    """One finding per VERL_PATCHES_* variable that is set: ok, or invalid (failing); none when
    none is set, so the doctor's output is then what it always was."""
    return [Finding(f"env:{s.name}", "environment", "ok" if s.ok else "invalid", s.detail, s.raw,
                    overlay_env.BY_NAME[s.name].allowed() if s.name in overlay_env.BY_NAME else None, True)
            for s in overlay_env.settings(environ)]


def as_json(findings: list[Finding]) -> list[dict]:
    return [asdict(f) | {"failed": f.failed} for f in findings]


LAYER_SPEC_TIMEOUT_S = 900  # the adaptor's import and Megatron's argument check: seconds; a stuck import is named


def layer_spec_finding(config_name: str, overrides: list[str] | tuple[str, ...] = (), root: Path | None = None,
                       rehearsal_site: Path | None = None) -> tuple[Finding, list[str]]:
    """The ``layer-spec`` finding for ``config_name`` (NPU platform) and the lines that list its classes.
    ``rehearsal_site``: the NPU rehearsal platform's stand-in site, where that platform is selected.

    Not resolved (``upstream_absent``: the lock's lines fail for it) where torch_npu or MindSpeed-LLM is not
    importable and the NPU rehearsal platform is not selected. Otherwise ok, or invalid naming every class that
    is not a real implementation, or the step that failed."""
    env = dict(os.environ)
    target = f"configs/{config_name}.yaml"
    absent = [m for m in ("torch_npu", "mindspeed_llm") if importlib.util.find_spec(m) is None
              and not (m == "torch_npu" and rehearsal_site is not None)]
    if absent:
        return Finding("layer-spec", target, "missing", f"not resolved: {', '.join(absent)} not importable here",
                       None, None, True, upstream_absent=True), []
    path = [str(root)] if root is not None else []
    if rehearsal_site is not None:
        path.insert(0, str(rehearsal_site))  # the stand-in before verl decides its device (entry_points)
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    with tempfile.TemporaryDirectory(prefix="layer_spec_") as tmp:
        out = Path(tmp) / "layer_spec.json"
        cmd = [sys.executable, "-m", "verl_patches.checks.layer_spec", "--config-name", config_name, "--json", str(out),
               "--", *overrides]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAYER_SPEC_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Finding("layer-spec", target, "invalid", f"not resolved in {LAYER_SPEC_TIMEOUT_S} s: "
                           f"{' '.join(cmd)} did not finish", None, None, True), []
        result = json.loads(out.read_text()) if out.is_file() else {
            "error": f"exit {proc.returncode} without a result: " + "\n".join(proc.stderr.splitlines()[-5:])}
    if "error" in result:
        return Finding("layer-spec", target, "invalid", f"not resolved: {result['error']}", None, None, True), []
    lines = [f"{c['path']}: {c['class']} [{c['release']}]" for c in result["classes"]]
    header = f"layer spec of {config_name} (world {result['world_size']}, layout {result['layout']}):"
    if result["problems"]:
        return Finding("layer-spec", target, "invalid",
                       f"{len(result['problems'])} class(es) are not real implementations: "
                       + "; ".join(result["problems"]), None, None, True), [header, *lines]
    releases = sorted({c["release"] for c in result["classes"]})
    return Finding("layer-spec", target, "ok", f"{len(lines)} classes, each a real implementation, from "
                   + ", ".join(releases), None, None, True), [header, *lines]
