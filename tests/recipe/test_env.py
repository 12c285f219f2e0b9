"""The runtime environment file (scripts/cluster/recipe_env.sh) against docs/RECIPE.md "Environment parity",
the readers it names, and what the launchers do with it.

Real: the file is sourced by bash; the readers are looked up in the installed upstream packages (the
CANN / torch_npu / glibc readers cannot be checked on this machine and are not).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV_FILE = REPO / "scripts" / "cluster" / "recipe_env.sh"
DOC = REPO / "docs" / "RECIPE.md"
# The reference variables the parity issue named: each must have a row (set, or not set with a reason).
NAMED = {"HCCL_OP_EXPANSION_MODE", "TASK_QUEUE_ENABLE", "PYTORCH_NPU_ALLOC_CONF", "CUDA_DEVICE_MAX_CONNECTIONS",
         "HCCL_BUFFSIZE", "HCCL_CONNECT_TIMEOUT", "LD_PRELOAD", "RECIPE_OPEN_FILES", "VLLM_ASCEND_ENABLE_TOPK_OPTIMIZE",
         "VLLM_USE_V1", "ASCEND_NPU_SLEEP_DISABLE", "VLLM_DISABLE_MEMORY_POOL", "VLLM_HOST_IP"}
PACKAGES = {"vllm-ascend": "vllm_ascend", "vllm": "vllm", "verl": "verl", "megatron-core": "megatron", "ray": "ray",
            "hydra-core": "hydra"}


def env_rows() -> list[list[str]]:
    table = ENV_FILE.read_text().split("cat <<'TABLE'\n", 1)[1].split("\nTABLE", 1)[0]
    return [line.split("|") for line in table.splitlines()]


def doc_rows() -> list[list[str]]:
    section = DOC.read_text().split("## Environment parity", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 6:
            rows.append(cells)
    return rows


# How Python code reads an environment variable: os.getenv / os.environ[...] / .get(...) / "X" in os.environ,
# vLLM-style envs tables ("X": lambda ...), Ray's env_bool / env_integer and Hydra's _is_env_set.
READ = (r"""(getenv|environ(\.get)?|_is_env_set|env_bool|env_integer|is_set)\s*[\(\[]\s*["'][A-Z0-9_]+["']"""
        r"""|["'][A-Z0-9_]+["']\s*:\s*(lambda|\()|["'][A-Z0-9_]+["']\s+in\s+os\.environ""")


def _names_read(import_name: str) -> set[str]:
    """Every environment variable name a package's Python sources read (one grep over the package)."""
    spec = importlib.util.find_spec(import_name)
    root = spec.submodule_search_locations[0]
    out = subprocess.run(["grep", "-rhoE", "--include=*.py", READ, root], capture_output=True, text=True).stdout
    return set(re.findall(r"""["']([A-Z0-9_]+)["']""", out))


@pytest.fixture(scope="module")
def sources():
    return {imp: _names_read(imp) for imp in [*PACKAGES.values(), "mindspeed"] if importlib.util.find_spec(imp) is not None}


def test_every_row_is_well_formed_and_every_named_variable_has_one():
    rows = env_rows()
    names = [r[0] for r in rows]
    assert all(len(r) == 7 for r in rows) and len(names) == len(set(names))
    assert NAMED <= set(names), NAMED - set(names)
    for name, _ref, where, default, pattern, reader, why in rows:
        assert where in ("any", "npu", "cuda") and reader and why, name
        if default != "-":
            re.compile(pattern)
            if not default.startswith("@"):
                assert re.search(pattern, default), f"{name}: default {default!r} fails its own pattern"


def test_the_doc_table_is_the_file():
    def shown(x):
        return "—" if x == "-" else f"`{x}`"

    want = [[f"`{n}`", shown(ref), "not set" if d == "-" else f"`{d}`", w, reader, why]
            for n, ref, w, d, _p, reader, why in env_rows()]
    assert doc_rows() == want


def test_named_readers_read_it_and_absent_readers_do_not(sources):
    checked = 0
    for name, _ref, _where, _default, _pattern, reader, _why in env_rows():
        if reader.startswith("nothing"):
            for imp, text in sources.items():
                assert name not in text, f"{name}: the table says nothing reads it, but {imp} does"
            checked += 1
            continue
        for dist, imp in PACKAGES.items():
            if re.match(rf"{re.escape(dist)} \d", reader) or f", {dist} " in reader or f"{dist} " in reader.split("(")[0]:
                if imp in sources:
                    assert name in sources[imp], f"{name}: the table names {imp} as a reader, but it does not read it"
                    checked += 1
    assert checked >= 15


def _apply(*lines, **env):
    script = "set -euo pipefail\nsource scripts/cluster/recipe_env.sh\n" + "\n".join(lines)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HCCL_", "VLLM_", "ASCEND_", "TASK_QUEUE"))}
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**base, **env})


def test_apply_exports_defaults_keeps_the_environments_value_and_refuses_a_bad_one():
    r = _apply("SOCKET_IFNAME=lo", "recipe_env_apply npu", "recipe_env_print",
               'echo "AIV=$(printenv HCCL_OP_EXPANSION_MODE) BUF=$(printenv HCCL_BUFFSIZE)"', HCCL_BUFFSIZE="400")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "HCCL_OP_EXPANSION_MODE=AIV  [recipe default; read by CANN 8.2.RC1 HCCL]" in out
    assert "HCCL_BUFFSIZE=400  [environment;" in out and "AIV=AIV BUF=400" in out
    assert "not set by the launcher" in out and "ASCEND_NPU_SLEEP_DISABLE" in out
    r = _apply("recipe_env_apply npu", HCCL_BUFFSIZE="big")
    assert r.returncode == 2 and "HCCL_BUFFSIZE='big' (environment) does not match" in r.stderr
    # CUDA: the Ascend rows are left alone.
    r = _apply("SOCKET_IFNAME=lo", "recipe_env_apply cuda", "recipe_env_print")
    assert r.returncode == 0 and "HCCL_" not in r.stdout and "CUDA_DEVICE_MAX_CONNECTIONS=1" in r.stdout


def test_vllm_version_is_the_locks():
    from verl_patches.core.lock import load_lock

    (row,) = [r for r in env_rows() if r[0] == "VLLM_VERSION"]
    assert row[3] == load_lock()["vllm"].version
