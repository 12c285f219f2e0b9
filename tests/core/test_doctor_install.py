"""The doctor fails on an install whose vLLM plugin entry points name a function the source tree no longer
defines (an editable install made before a module moved): vLLM would only log that the plugin failed to
load, and its processes would run unpatched. Stand-in, declared: the installed distribution's metadata
(importlib.metadata's EntryPoint objects, real; the distribution object around them a namespace)."""

from __future__ import annotations

import types
from importlib import metadata

from verl_patches.core import doctor


def _installed(monkeypatch, *values):
    eps = [metadata.EntryPoint("verl_patches", v, g) for v, g in values]
    monkeypatch.setattr(metadata, "distribution", lambda name: types.SimpleNamespace(entry_points=eps))


def test_a_stale_plugin_entry_point_fails_the_doctor(monkeypatch):
    _installed(monkeypatch, ("verl_patches.prelude:vllm_plugin", "vllm.general_plugins"),
               ("verl_patches.rigs.cpu.vllm_platform:register", "vllm.platform_plugins"))
    found = doctor.install_findings()
    assert [f.id for f in found] == ["install:vllm.general_plugins"]
    assert found[0].failed and doctor.is_failing(found[0], strict=False)
    assert "verl_patches.prelude:vllm_plugin" in found[0].detail and "pip install -e ." in found[0].detail


def test_entry_points_that_resolve_add_nothing(monkeypatch):
    _installed(monkeypatch, ("verl_patches.entry_points:vllm_plugin", "vllm.general_plugins"),
               ("verl_patches.rigs.cpu.vllm_platform:register", "vllm.platform_plugins"),
               ("verl_patches.entry_points:no_such_function", "console_scripts"))  # not a plugin group
    assert doctor.install_findings() == []


def test_a_missing_function_in_an_existing_module_is_named(monkeypatch):
    _installed(monkeypatch, ("verl_patches.entry_points:old_plugin", "vllm.general_plugins"))
    assert [f.installed for f in doctor.install_findings()] == ["verl_patches.entry_points:old_plugin"]


def test_the_pyproject_entry_points_resolve_in_this_tree():
    import tomllib

    from tests.helpers import REPO

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    for group in doctor.PLUGIN_GROUPS:
        for value in project[group].values():
            module, _, attr = value.partition(":")
            assert doctor._defines(module, attr), value
