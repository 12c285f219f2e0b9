"""Docker image pins against the version lock, run_container.sh in --dry-run, and the shell/Dockerfile linters.

Linters: shellcheck and hadolint (HADOLINT=path or on PATH); skipped when absent unless REQUIRE_LINTERS=1 (CI).
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verl_patches.core.lock import load_lock

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
SHELL_SCRIPTS = sorted([*REPO.glob("scripts/*.sh"), *REPO.glob("scripts/cluster/*.sh"), *REPO.glob("docker/*.sh"),
                        REPO / "run_container.sh", REPO / ".ci" / "run"])


def _expected_from_lock():
    c = load_lock()
    return {
        "CANN_TAG": c["cann"].ref.lower(),
        "TORCH_VERSION": c["torch"].version,
        "TORCH_NPU_VERSION": c["torch_npu"].version,
        "VLLM_VERSION": c["vllm"].version,
        "VLLM_SDIST_SHA256": c["vllm"].sdist_sha256,
        "VLLM_ASCEND_VERSION": c["vllm_ascend"].version,
        "MEGATRON_CORE_VERSION": c["megatron_core"].version,
        "MINDSPEED_REPO": c["mindspeed"].repo,
        "MINDSPEED_REF": c["mindspeed"].ref,
        "MINDSPEED_COMMIT": c["mindspeed"].commit,
    }


def _dockerfile_args():
    args = {}
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"ARG\s+(\w+)(?:=(.*))?$", line.strip())
        if m:
            args[m.group(1)] = (m.group(2) or "").strip('"')
    return args


def test_dockerfile_defaults_equal_the_lock():
    args = _dockerfile_args()
    for name, want in _expected_from_lock().items():
        assert args.get(name) == want, f"Dockerfile ARG {name}={args.get(name)!r}, lock says {want!r}"


def test_dockerfile_uses_its_args_and_pins_nothing_else():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M)
    assert "${CANN_TAG}-a3-ubuntu22.04-py3.11" in _dockerfile_args()["BASE_IMAGE"]
    for name in _expected_from_lock():
        if name != "CANN_TAG":
            assert "${" + name + "}" in text, f"ARG {name} is declared but not used"
    # Versions of locked packages appear only as ARG defaults, never typed again in a RUN.
    run_lines = "\n".join(l for l in text.splitlines() if not l.startswith("ARG"))
    for pkg in ("torch==2", "vllm==0", "vllm-ascend==0", "megatron-core==0", "verl=="):
        assert pkg not in run_lines


def test_build_sh_passes_the_lock_as_build_args():
    r = subprocess.run(["bash", str(REPO / "docker" / "build.sh"), "--print"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable), timeout=30)
    assert r.returncode == 0, r.stderr
    words = shlex.split(r.stdout)
    passed = dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--build-arg")
    assert passed == _expected_from_lock()
    assert words[-1] == str(REPO) and words[words.index("-f") + 1] == str(DOCKERFILE)


def _run_container(tmp_path, *args, **env):
    return subprocess.run(["bash", str(REPO / "run_container.sh"), *args], capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=30)


def test_run_container_npu_devices_and_mounts(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for n in ("davinci0", "davinci1", "davinci15", "davinci_manager", "devmm_svm", "hisi_hdc"):
        (dev / n).touch()
    data = tmp_path / "data"
    data.mkdir()
    r = _run_container(tmp_path, "--dry-run", "bash", DEV_ROOT=str(dev), MOUNTS=f"{data} {tmp_path}/absent", SHM_SIZE="64g")
    assert r.returncode == 0, r.stderr
    words = shlex.split(r.stdout)
    devices = [words[i + 1] for i, w in enumerate(words) if w == "--device"]
    assert sorted(Path(d).name for d in devices) == sorted(["davinci0", "davinci1", "davinci15", "davinci_manager",
                                                             "devmm_svm", "hisi_hdc"])
    assert "--network" in words and words[words.index("--network") + 1] == "host"
    assert words[words.index("--shm-size") + 1] == "64g"
    assert "/usr/local/Ascend/driver:/usr/local/Ascend/driver:ro" in words
    assert f"{data}:{data}" in words and "absent" in r.stderr
    assert words[-2:] == ["recipe-dsv3-grpo:latest", "bash"]


def test_run_container_errors_without_devices(tmp_path):
    r = _run_container(tmp_path, "--dry-run", DEV_ROOT=str(tmp_path))
    assert r.returncode == 2 and "no NPU device nodes" in r.stderr
    (tmp_path / "davinci0").touch()
    r = _run_container(tmp_path, "--dry-run", DEV_ROOT=str(tmp_path))
    assert r.returncode == 2 and "davinci_manager missing" in r.stderr
    r = _run_container(tmp_path, "--dry-run", DEVICE="cuda", MOUNTS="")
    assert r.returncode == 0 and "--gpus all" in r.stdout


def _linter(name, env_var):
    # PATH, or the running venv's bin/ (pip-installed linters land there without activation).
    path = os.environ.get(env_var) or shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not path:
        if os.environ.get("REQUIRE_LINTERS") == "1":
            pytest.fail(f"{name} not installed but REQUIRE_LINTERS=1")
        pytest.skip(f"{name} not installed (set {env_var} or put it on PATH; CI sets REQUIRE_LINTERS=1)")
    return path


def test_shellcheck():
    sc = _linter("shellcheck", "SHELLCHECK")
    assert len(SHELL_SCRIPTS) >= 6
    r = subprocess.run([sc, "-x", *map(str, SHELL_SCRIPTS)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint():
    hl = _linter("hadolint", "HADOLINT")
    r = subprocess.run([hl, str(DOCKERFILE)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_build_context_excludes_the_venv_and_keeps_what_is_copied():
    ignore = (REPO / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore
    copied = re.findall(r"^COPY (\S+)", DOCKERFILE.read_text(), re.M)
    assert copied and not any(c.split("/")[0] in ignore for c in copied)
