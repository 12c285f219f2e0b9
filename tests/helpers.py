"""Small helpers shared by tests: run the overlay's CLI or a Python snippet in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


def run_py(code_or_args: str | list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
           timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -c CODE`` (str) or ``python ARGS`` (list) with the test environment's interpreter."""
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    full_env = dict(os.environ)
    full_env.setdefault("VLLM_PLUGINS", "verl_patches")
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(FIXTURES), str(REPO), *([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])])
    full_env.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env,
                          cwd=str(cwd or REPO), timeout=timeout)


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run_py(["-m", "verl_patches", *args], env=env, cwd=cwd)
