"""The single hook reaches every process kind, once: copied-in upstream, fork, spawn, Ray, vLLM plugins."""

import json
import shutil

import pytest

from tests.helpers import REPO, cli, run_py
from verl_patches.prelude import patches_for

PATCH_ID = "verl.reward_score.deepscaler"


def expected(phase: str, without: str | None = None) -> list[str]:
    """Every registered patch of the phase: what one prelude run must apply, exactly once."""
    return sorted(p.id for p in patches_for(phase) if p.id != without)
# Printed by the snippets below: which patches the process applied, and whether the target
# carries exactly one layer of our wrapper (the original under it is unmarked).
REPORT = r"""
import json, verl.utils.reward_score as rs
from verl_patches.core.apply import applied
f = rs.default_compute_score
layers = 0
while getattr(f, "__verl_patch_id__", None):
    layers += 1
    f = f.__verl_patch_original__
print("REPORT" + json.dumps({"applied": sorted(applied()), "layers": layers, "file": rs.__file__}))
"""


def _report(stdout: str) -> dict:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("REPORT"))
    return json.loads(line[len("REPORT"):])


@pytest.fixture(scope="module")
def copied_verl(tmp_path_factory):
    """verl copied next to the overlay (the README's copy-in layout) with the hook line added."""
    import verl

    root = tmp_path_factory.mktemp("upstream")
    shutil.copytree(verl.__path__[0], root / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    r = cli("hook", "install", "--upstream-root", str(root))
    assert r.returncode == 0 and "added the prelude line" in r.stdout, r.stderr
    assert "already present" in cli("hook", "install", "--upstream-root", str(root)).stdout
    assert cli("hook", "check", "--upstream-root", str(root)).returncode == 0
    return root


@pytest.mark.slow
def test_importing_the_package_changes_nothing():
    r = run_py(r"""
import importlib, pkgutil, verl.utils.reward_score as rs
import vllm  # as in every process of the run: vLLM itself loads the CPU platform module it names
before = rs.default_compute_score
import verl_patches
for m in pkgutil.walk_packages(verl_patches.__path__, "verl_patches."):
    if m.name.endswith(("prelude_patch", "__main__")):
        continue
    importlib.import_module(m.name)
from verl_patches.core.apply import applied
assert rs.default_compute_score is before, "an import changed upstream"
assert applied() == {}
print("UNCHANGED")
""")
    assert "UNCHANGED" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_hook_in_copied_worker_module_applies_once(copied_verl):
    # Import verl's real worker module from the copied tree twice (and reload the hook):
    # the patch is applied exactly once, and the alias in a reward manager follows.
    r = run_py("""
import importlib, verl.workers.megatron_workers
import verl.workers.megatron_workers
import verl_patches.prelude_patch as pp
importlib.reload(pp)
import verl.workers.reward_manager.naive as naive, verl.utils.reward_score as rs
assert naive.default_compute_score is rs.default_compute_score
""" + REPORT, env={"PYTHONPATH": f"{copied_verl}"}, cwd=copied_verl)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = _report(r.stdout)
    assert rep["file"].startswith(str(copied_verl)), "the copied tree must be the one imported"
    assert rep["applied"] == expected("driver") and rep["layers"] == 1
    assert PATCH_ID in rep["applied"]


def test_hook_remove_restores_the_file(copied_verl, tmp_path):
    import verl.workers.megatron_workers as upstream_worker  # the untouched installed copy

    root = tmp_path / "u"
    shutil.copytree(copied_verl, root)
    assert "removed" in cli("hook", "remove", "--upstream-root", str(root)).stdout
    assert cli("hook", "check", "--upstream-root", str(root)).returncode == 1
    restored = (root / "verl" / "workers" / "megatron_workers.py").read_text()
    assert restored == open(upstream_worker.__file__).read()


@pytest.mark.slow
def test_forked_and_spawned_children_never_stack():
    r = run_py([str(REPO / "tests" / "fixtures" / "prelude_children.py")])
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("CHILDREN"))[len("CHILDREN"):])
    # Fork inherits the patched modules: nothing new to apply, one layer.
    assert out["fork"] == {"again": [], "layers": 1, "applied_here": expected("driver")}
    # Spawn starts clean: the hook applies once in the child, a second call adds nothing.
    assert out["spawn"] == {"again": [], "layers": 1, "applied_here": expected("driver")}


@pytest.mark.slow
def test_vllm_general_plugin_entry_point_applies_the_prelude():
    r = run_py("""
import importlib.metadata as md
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "verl_patches"]
assert eps and eps[0].value == "verl_patches.entry_points:vllm_plugin", eps
from vllm.plugins import load_general_plugins
load_general_plugins()
""" + REPORT, env={"VLLM_PLUGINS": "verl_patches"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert _report(r.stdout)["applied"] == expected("driver")


@pytest.mark.slow
def test_disable_list_and_off_switch():
    r = run_py("from verl_patches import prelude_patch\n" + REPORT, env={"VERL_PATCHES_DISABLE": PATCH_ID})
    rep = _report(r.stdout)
    assert rep["applied"] == expected("driver", without=PATCH_ID) and rep["layers"] == 0
    r = run_py("from verl_patches import prelude_patch\n" + REPORT, env={"VERL_PATCHES_OFF": "1"})
    assert _report(r.stdout)["applied"] == []


# Real Ray: verl's TaskRunner (driver phase) and its worker-group actors (worker phase) import the
# hooked worker module and apply every patch of their phase; tests/recipe/test_train_tiny.py checks
# it inside verl's own trainer, with the count of each phase's patches per process.
