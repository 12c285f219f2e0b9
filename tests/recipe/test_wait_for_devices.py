"""scripts/cluster/wait_for_devices.py honours --timeout (finding 7): against a head that does not
answer it exits 3 with a message at the timeout instead of waiting on Ray's own retries (an
unreachable head kept it running past 400 s with --timeout 10)."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cluster" / "wait_for_devices.py"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_unreachable_head_times_out_on_time(capsys):
    spec = importlib.util.spec_from_file_location("wait_for_devices", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    port = _closed_port()
    t0 = time.monotonic()
    rc = mod.main(["--address", f"127.0.0.1:{port}", "--resource", "GPU", "--expected", "8", "--nodes", "1",
                   "--timeout", "1.5", "--interval", "0.5"])
    took = time.monotonic() - t0
    assert rc == 3 and f"127.0.0.1:{port} was not reachable within 2 s" in capsys.readouterr().err
    assert 1.4 < took < 5, took


@pytest.mark.timeout(60)
def test_a_head_port_that_never_answers_ray_times_out_on_time():
    """The port accepts TCP but never speaks Ray's protocol: ray.init would block in native code."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, str(SCRIPT), "--address", f"127.0.0.1:{port}", "--resource", "GPU",
                            "--expected", "8", "--nodes", "1", "--timeout", "1", "--interval", "0.5"],
                           capture_output=True, text=True, timeout=50)
        took = time.monotonic() - t0
    assert r.returncode == 3, r.stderr
    assert "port accepts connections but Ray does not respond" in r.stderr or "could not connect" in r.stderr
    assert took < 20, took  # 1 s + 2.5 s of grace, plus importing ray


@pytest.mark.timeout(60)
def test_a_head_that_exited_is_reported_at_once_with_its_log(tmp_path):
    """Issue 29, item 4: the head died at once on a busy port, whose other owner accepts connections; the
    wait used to last the whole --timeout and then blame a silent port. It watches the head's process."""
    log = tmp_path / "ray_head.log"
    log.write_text("starting\nValueError: Failed to bind to address 127.0.0.1:6379: the port is in use\n")
    head = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    head.wait()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(16)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, str(SCRIPT), "--address", f"127.0.0.1:{port}", "--resource", "GPU",
                            "--expected", "8", "--nodes", "1", "--timeout", "300", "--interval", "0.5",
                            "--head-pid", str(head.pid), "--head-log", str(log)],
                           capture_output=True, text=True, timeout=50)
        took = time.monotonic() - t0
    assert r.returncode == 3, r.stderr
    assert f"the Ray head process (pid {head.pid}) exited while waiting for the cluster at 127.0.0.1:{port}" in r.stderr
    assert "  | ValueError: Failed to bind to address 127.0.0.1:6379" in r.stderr
    assert "Ray does not respond" not in r.stderr
    assert took < 15, took
