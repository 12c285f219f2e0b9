"""The prelude hook never damages verl's worker module (finding 3): writes are atomic, so a full
disk leaves the module as it was; a module an older version left cut short mid-line is repaired
by `hook install` and named by `hook check` and the doctor instead of crashing them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO
from verl_patches.cli import main
from verl_patches.core import hook


@pytest.fixture
def root(tmp_path):
    """A copied-in verl holding only the worker module (what --upstream-root reads)."""
    import verl.workers.megatron_workers as mw

    (tmp_path / "verl" / "workers").mkdir(parents=True)
    shutil.copy(mw.__file__, tmp_path / "verl" / "workers" / "megatron_workers.py")
    return tmp_path


def _module(root):
    return root / "verl" / "workers" / "megatron_workers.py"


def test_install_on_a_full_disk_leaves_the_module_as_it_was(root):
    path = _module(root)
    before = path.read_bytes()
    # RLIMIT_FSIZE stands in for a full disk: no file may grow past the module's size + 20 bytes,
    # so the write of the module with the line appended fails part-way.
    code = ("import resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({len(before) + 20}, {len(before) + 20}))\n"
            "from verl_patches.cli import main\n"
            f"sys.exit(main(['hook', 'install', '--upstream-root', {str(root)!r}]))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "could not write" in r.stderr and "the file is unchanged" in r.stderr and "Traceback" not in r.stderr
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["megatron_workers.py"]  # no temporary left


def test_a_line_cut_short_is_named_by_check_and_doctor_and_repaired_by_install(root, capsys):
    from verl_patches.core.doctor import run_doctor
    from verl_patches.patches import load_catalogue

    path = _module(root)
    original = path.read_text()
    path.write_text(original + "\n" + hook.LINE[:20])  # what an interrupted in-place write left
    assert main(["hook", "check", "--upstream-root", str(root)]) == 1
    assert "cut short by an interrupted write" in capsys.readouterr().err
    findings, code = run_doctor(load_catalogue(), "cpu", root)
    worker = [f for f in findings if f.target.startswith(hook.WORKER_MODULE + ":")]
    assert worker and all(f.status == "changed" and "is not valid Python" in f.detail for f in worker)
    assert code == 1
    assert main(["hook", "install", "--upstream-root", str(root)]) == 0
    assert path.read_text() == original + "\n" + hook.LINE + "\n"
    assert main(["hook", "check", "--upstream-root", str(root)]) == 0
    assert main(["hook", "remove", "--upstream-root", str(root)]) == 0
    assert path.read_text() == original


def test_a_module_damaged_elsewhere_is_refused_untouched(root, capsys):
    path = _module(root)
    damaged = path.read_text()[:5000]  # cut inside upstream code, not in our line
    path.write_text(damaged)
    for action in ("install", "remove", "check"):
        assert main(["hook", action, "--upstream-root", str(root)]) == 1
        err = capsys.readouterr().err
        assert "is not valid Python" in err and "reinstall verl" in err
    assert path.read_text() == damaged
