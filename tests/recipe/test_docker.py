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
# The Ascend image and the CUDA one (docs/NVIDIA.md).
DOCKERFILES = [DOCKERFILE, *[p for p in [REPO / "docker" / "Dockerfile.cuda"] if p.exists()]]
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


def test_the_image_installs_the_source_only_components_from_the_lock_itself():
    """MindSpeed, Megatron-LM's training package and MindSpeed-LLM: the image runs the test environment's
    installer with the lock copied in before it (no build arg to drift), after megatron-core (the training
    package goes beside megatron/core), and requires every one of them."""
    text = DOCKERFILE.read_text()
    run = "RUN bash /opt/recipe/scripts/install_upstream_sources.sh --require python3"
    assert run in text and "MINDSPEED" not in text
    before = text[:text.index(run)]
    for src in ("configs/upstream.lock.toml", "scripts/install_upstream_sources.sh", "verl_patches/core/sources.py"):
        assert f"COPY {src} /opt/recipe/{src}" in before, src
    assert '"megatron-core==${MEGATRON_CORE_VERSION}"' in before


def _expected_from_cuda_lock():
    from verl_patches.core.lock import CUDA_LOCK_PATH

    c = load_lock(CUDA_LOCK_PATH)
    return {"TORCH_VERSION": c["torch"].version, "TORCHVISION_VERSION": c["torchvision"].version,
            "TORCHAUDIO_VERSION": c["torchaudio"].version, "XFORMERS_VERSION": c["xformers"].version,
            "VLLM_VERSION": c["vllm"].version, "MEGATRON_CORE_VERSION": c["megatron_core"].version,
            "TRANSFORMER_ENGINE_VERSION": c["transformer_engine"].version,
            "FLASH_ATTN_VERSION": c["flash_attn"].version,
            "TORCH_MEMORY_SAVER_VERSION": c["torch_memory_saver"].version}


def test_the_cuda_image_follows_the_cuda_lock():
    path = REPO / "docker" / "Dockerfile.cuda"
    args = {m.group(1): (m.group(2) or "").strip('"') for line in path.read_text().splitlines()
            if (m := re.match(r"ARG\s+(\w+)(?:=(.*))?$", line.strip()))}
    for name, want in _expected_from_cuda_lock().items():
        assert args.get(name) == want, f"Dockerfile.cuda ARG {name}={args.get(name)!r}, the CUDA lock says {want!r}"
    r = subprocess.run(["bash", str(REPO / "docker" / "build.sh"), "--cuda", "--print"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHON=sys.executable), timeout=300)
    assert r.returncode == 0, r.stderr
    words = shlex.split(r.stdout)
    assert dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--build-arg") == _expected_from_cuda_lock()
    assert words[words.index("-f") + 1] == str(path)


def test_build_sh_passes_the_lock_as_build_args():
    r = subprocess.run(["bash", str(REPO / "docker" / "build.sh"), "--print"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable), timeout=300)
    assert r.returncode == 0, r.stderr
    words = shlex.split(r.stdout)
    passed = dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--build-arg")
    assert passed == _expected_from_lock()
    assert words[-1] == str(REPO) and words[words.index("-f") + 1] == str(DOCKERFILE)


def _run_container(tmp_path, *args, **env):
    return subprocess.run(["bash", str(REPO / "run_container.sh"), *args], capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=300)


def _fake_docker(tmp_path, state):
    """Declared stand-in for the docker CLI (no docker daemon here): answers `container inspect` with
    STATE (absent / running / stopped) and logs every call, so the script's choices can be checked."""
    log = tmp_path / "docker.log"
    fake = tmp_path / "docker"
    fake.write_text(f"""#!/bin/sh
echo "$*" >> {log}
if [ "$1 $2" = "container inspect" ]; then
  case {state} in absent) exit 1 ;; running) echo true ;; stopped) echo false ;; esac
fi
exit 0
""")
    fake.chmod(0o755)
    return str(fake), log


def _npu_dev(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for n in ("davinci0", "davinci1", "davinci15", "davinci_manager", "devmm_svm", "hisi_hdc"):
        (dev / n).touch()
    return dev


def test_run_container_takes_the_references_call_and_creates_the_named_container(tmp_path):
    dev = _npu_dev(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    docker, _ = _fake_docker(tmp_path, "absent")
    # The reference's call: bash run_container.sh your_docker_name
    r = _run_container(tmp_path, "--dry-run", "my_box", DEV_ROOT=str(dev), MOUNTS=f"{data} {tmp_path}/absent",
                       SHM_SIZE="64g", DOCKER=docker)
    assert r.returncode == 0, r.stderr
    assert "container 'my_box' on this node not found: create it from recipe-dsv3-grpo:latest" in r.stderr
    run, exec_ = (shlex.split(line) for line in r.stdout.strip().splitlines())
    assert run[1:4] == ["run", "-d", "-it"] and run[run.index("--name") + 1] == "my_box"
    devices = [run[i + 1] for i, w in enumerate(run) if w == "--device"]
    assert sorted(Path(d).name for d in devices) == sorted(["davinci0", "davinci1", "davinci15", "davinci_manager",
                                                             "devmm_svm", "hisi_hdc"])
    assert run[run.index("--network") + 1] == "host" and run[run.index("--shm-size") + 1] == "64g"
    assert "/usr/local/Ascend/driver:/usr/local/Ascend/driver:ro" in run
    assert f"{data}:{data}" in run and "absent" in r.stderr
    assert run[-2:] == ["recipe-dsv3-grpo:latest", "/bin/bash"]
    assert exec_[1:] == ["exec", "-it", "my_box", "bash"]
    # NAME IMAGE -- COMMAND
    r = _run_container(tmp_path, "--dry-run", "box2", "my/image:1", "--", "python", "-V", DEV_ROOT=str(dev), MOUNTS="",
                       DOCKER=docker)
    run, exec_ = (shlex.split(line) for line in r.stdout.strip().splitlines())
    assert run[-2:] == ["my/image:1", "/bin/bash"] and exec_[-3:] == ["box2", "python", "-V"]


@pytest.mark.parametrize("state, said, first", [("running", "running: run 'bash' in it", "exec"),
                                                ("stopped", "exists, stopped: start it", "start")])
def test_run_container_reuses_an_existing_container(tmp_path, state, said, first):
    docker, log = _fake_docker(tmp_path, state)
    r = _run_container(tmp_path, "--dry-run", "box", DEV_ROOT=str(_npu_dev(tmp_path)), MOUNTS="", DOCKER=docker)
    assert r.returncode == 0 and said in r.stderr
    assert shlex.split(r.stdout.splitlines()[0])[1] == first
    assert log.read_text().splitlines() == ["container inspect -f {{.State.Running}} box"]  # dry run: asked only


def test_run_container_creates_then_enters_for_real_with_the_stand_in(tmp_path):
    docker, log = _fake_docker(tmp_path, "absent")
    r = _run_container(tmp_path, "box", DEV_ROOT=str(_npu_dev(tmp_path)), MOUNTS="", DOCKER=docker)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("container inspect") and calls[1].startswith("run -d -it --name box")
    assert calls[2] == "exec -it box bash"


def test_run_container_errors_are_named(tmp_path):
    r = _run_container(tmp_path, "--dry-run", DEV_ROOT=str(tmp_path), DOCKER="no-docker-here")
    assert r.returncode == 2 and "no NPU device nodes" in r.stderr
    (tmp_path / "davinci0").touch()
    r = _run_container(tmp_path, "--dry-run", DEV_ROOT=str(tmp_path), DOCKER="no-docker-here")
    assert r.returncode == 2 and "davinci_manager missing" in r.stderr
    r = _run_container(tmp_path, "--dry-run", DEVICE="cuda", MOUNTS="", DOCKER="no-docker-here")
    assert r.returncode == 0 and "--gpus all" in r.stdout and "assuming no container" in r.stderr
    r = _run_container(tmp_path, "a", "b", "c", DEVICE="cuda", MOUNTS="", DOCKER="no-docker-here")
    assert r.returncode == 2 and "at most NAME and IMAGE" in r.stderr
    r = _run_container(tmp_path, "bad name!", DEVICE="cuda", MOUNTS="", DOCKER="no-docker-here")
    assert r.returncode == 2 and "not a valid container name" in r.stderr
    r = _run_container(tmp_path, "box", DEVICE="cuda", MOUNTS="", DOCKER="no-docker-here")
    assert r.returncode == 2 and "no-docker-here not found" in r.stderr


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
    r = subprocess.run([sc, "-x", *map(str, SHELL_SCRIPTS)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint():
    hl = _linter("hadolint", "HADOLINT")
    r = subprocess.run([hl, *map(str, DOCKERFILES)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_build_context_excludes_the_venv_and_keeps_what_is_copied():
    ignore = (REPO / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore
    copied = re.findall(r"^COPY (\S+)", DOCKERFILE.read_text(), re.M)
    assert copied and not any(c.split("/")[0] in ignore for c in copied)


def _docker_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docker_check", REPO / "docker" / "check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_stages_pass_the_static_checks(dockerfile, capsys):
    _linter("shellcheck", "SHELLCHECK")
    assert _docker_check().main(["-f", str(dockerfile)]) == 0, capsys.readouterr().err


def test_the_stage_check_names_a_missing_copy_source_and_a_broken_run(tmp_path, capsys):
    _linter("shellcheck", "SHELLCHECK")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM scratch\nARG X=1\nCOPY no/such/file /opt/\nRUN if [ \"${X}\" = 1 ]; then echo x \\\n    && echo y\n")
    assert _docker_check().main(["-f", str(bad), "--context", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Dockerfile:3: COPY source no/such/file" in err and "Dockerfile:4: RUN body fails shellcheck" in err
