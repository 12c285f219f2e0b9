"""The upstream lock is the one source of versions: requirements, setup script and the environment agree."""

import re

import pytest
from packaging.requirements import Requirement

from tests.helpers import REPO
from verl_patches.core.lock import load_lock


def _requirements(path):
    reqs = {}
    for line in (REPO / path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            reqs[r.name.lower()] = r
    return reqs


def test_lock_names_every_recipe_component_with_repo_and_ref():
    lock = load_lock()
    expected = {"verl", "vllm", "vllm_ascend", "megatron_core", "mindspeed", "torch", "torch_npu", "cann",
                "transformers", "ray", "hydra_core"}
    assert expected <= lock.keys()
    for comp in lock.values():
        assert comp.ref, comp.key
        if comp.key != "cann":
            assert comp.repo and comp.repo.startswith("https://"), comp.key
    assert lock["vllm"].sdist_sha256 and len(lock["vllm"].sdist_sha256) == 64


def test_requirements_pin_exactly_the_lock_versions():
    reqs = _requirements("requirements.txt")
    for comp in load_lock().values():
        if not comp.package or not comp.install.startswith("pip") or comp.install.startswith("pip --no-deps") \
                or comp.platforms != ("any",):
            continue
        r = reqs.get(comp.package.lower())
        assert r is not None, f"{comp.package} is in the lock but not in requirements.txt"
        assert str(r.specifier) == f"=={comp.version}", f"{comp.package}: {r.specifier} vs lock {comp.version}"
    # Every requirement is pinned exactly (the reference's unpinned requirements were a defect).
    for name, r in {**reqs, **_requirements("requirements-test.txt")}.items():
        assert str(r.specifier).startswith("=="), f"{name} is not pinned"


def test_setup_script_takes_versions_from_the_lock_only():
    script = (REPO / "scripts" / "setup_test_env.sh").read_text()
    versions = {c.version for c in load_lock().values() if c.version}
    hard_coded = [v for v in versions if re.search(rf"==\s*{re.escape(v)}\b", script)]
    assert not hard_coded, f"versions written into setup_test_env.sh instead of read from the lock: {hard_coded}"


def test_the_test_environment_matches_the_lock():
    import importlib.metadata as md

    for comp in load_lock().values():
        if comp.package and comp.platforms == ("any",):
            installed = md.version(comp.package)
            assert installed.split("+")[0] == comp.version, f"{comp.package} {installed} != lock {comp.version}"


def test_the_cuda_graph_allocator_is_pinned_for_cuda_only():
    """torch_memory_saver: pinned (doctor --strict requires it on CUDA), never in the CPU environment."""
    comp = load_lock()["torch_memory_saver"]
    assert comp.platforms == ("cuda",) and comp.version == "0.0.10" and comp.required_on("cuda")
    assert not comp.required_on("cpu") and not comp.required_on("npu")
    for path in ("requirements.txt", "requirements-test.txt", "scripts/setup_test_env.sh"):
        assert "torch_memory_saver" not in (REPO / path).read_text().replace("-", "_"), path


def test_mindspeed_is_pinned_to_its_release_tag_commit_and_archive():
    ms = load_lock()["mindspeed"]
    assert ms.ref == "v2.1.0_core_r0.12.1" and re.fullmatch(r"[0-9a-f]{40}", ms.commit or "")
    assert ms.archive and re.fullmatch(r"[0-9a-f]{64}", ms.archive_sha256 or "")
    assert ms.package == "mindspeed" and ms.version


def _mindspeed_source(tmp_path, upstream_dir, **env):
    import os
    import subprocess
    import sys

    return subprocess.run(["bash", str(REPO / "scripts" / "install_mindspeed.sh"), "--print", sys.executable],
                          env=dict(os.environ, VERL_PATCHES_UPSTREAM_DIR=str(upstream_dir), **env),
                          capture_output=True, text=True, timeout=300)


def test_install_mindspeed_picks_the_archive_checks_its_sha_and_else_skips_with_a_note(tmp_path):
    # GIT=false: the tag lookup fails as it does on a machine with registry access only.
    r = _mindspeed_source(tmp_path, tmp_path, GIT="false")
    assert r.returncode == 0 and r.stdout.startswith("skip: no MindSpeed-2.1.0_core_r0.12.1.tar.gz found")
    assert str(tmp_path) not in r.stdout  # the stamp's line names no place (a moved checkout keeps its venv)
    (tmp_path / load_lock()["mindspeed"].archive).write_bytes(b"not the release")
    r = _mindspeed_source(tmp_path, tmp_path, GIT="false")
    assert r.returncode == 2 and "has sha256" in r.stderr and load_lock()["mindspeed"].archive_sha256 in r.stderr


def test_install_mindspeed_without_a_folder_named_looks_inside_and_beside_the_checkout(tmp_path):
    """No VERL_PATCHES_UPSTREAM_DIR: `upstream/` in the checkout wins over a sibling folder's `upstream/`."""
    import os
    import shutil
    import subprocess
    import sys

    archive = load_lock()["mindspeed"].archive
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    (checkout / "configs").mkdir()
    shutil.copy(REPO / "scripts" / "install_mindspeed.sh", checkout / "scripts")
    shutil.copy(REPO / "configs" / "upstream.lock.toml", checkout / "configs")
    env = {k: v for k, v in os.environ.items() if k != "VERL_PATCHES_UPSTREAM_DIR"}

    def source():
        return subprocess.run(["bash", str(checkout / "scripts" / "install_mindspeed.sh"), "--print", sys.executable],
                              env=dict(env, GIT="false"), capture_output=True, text=True, timeout=300)

    assert source().stdout.startswith("skip: no ")
    (tmp_path / "archives" / "upstream").mkdir(parents=True)
    (tmp_path / "archives" / "upstream" / archive).write_bytes(b"beside")
    r = source()  # found beside the checkout (and refused: not the release's bytes)
    assert r.returncode == 2 and str(tmp_path / "archives" / "upstream" / archive) in r.stderr
    (checkout / "upstream").mkdir()
    (checkout / "upstream" / archive).write_bytes(b"inside")
    r = source()
    assert r.returncode == 2 and f"checkout/upstream/{archive}" in r.stderr


def test_the_stamps_mindspeed_line_names_the_archive_by_content_not_by_place(tmp_path):
    """setup_test_env.sh stamps its venv with install_mindspeed.sh --print: the release archive found in
    two different folders gives one line (its sha256 and name), so a moved or linked checkout keeps
    its venv. Needs the release archive (in an upstream/ folder beside the checkout, as on CI)."""
    import os
    import shutil
    import subprocess
    import sys

    from verl_patches.core.lock import REPO_ROOT

    ms = load_lock()["mindspeed"]
    found = [d / ms.archive for d in [REPO_ROOT / "upstream", *REPO_ROOT.parent.glob("*/upstream")]
             if (d / ms.archive).is_file()]
    if not found:
        pytest.skip(f"no {ms.archive} beside or inside the checkout")
    lines = []
    for where in ("a", "b/c"):
        (tmp_path / where).mkdir(parents=True)
        shutil.copy(found[0], tmp_path / where / ms.archive)
        r = subprocess.run(["bash", str(REPO / "scripts" / "install_mindspeed.sh"), "--print", sys.executable],
                           env=dict(os.environ, VERL_PATCHES_UPSTREAM_DIR=str(tmp_path / where), GIT="false"),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        lines.append(r.stdout.strip())
    assert lines[0] == lines[1] == f"archive sha256:{ms.archive_sha256} {ms.archive}"


def test_the_mindspeed_record_names_the_locks_release():
    from verl_patches.patches.mindspeed.patch_arguments import RELEASE_COMMIT, RELEASE_TAG

    ms = load_lock()["mindspeed"]
    assert (RELEASE_TAG, RELEASE_COMMIT) == (ms.ref, ms.commit)


def test_the_cuda_lock_differs_only_where_it_says_and_matches_vllms_cuda_build():
    import os
    import tarfile

    from verl_patches.core.lock import CUDA_LOCK_PATH

    base, cuda = load_lock(), load_lock(CUDA_LOCK_PATH)
    # The same releases of everything both stacks share.
    for key in ("verl", "vllm", "megatron_core", "transformers", "ray", "hydra_core", "numpy"):
        assert (cuda[key].version, cuda[key].ref) == (base[key].version, base[key].ref), key
    assert not {"torch_npu", "cann", "vllm_ascend", "mindspeed"} & cuda.keys()
    # Graph mode is the GPU configs' default: its address-keeping allocator is required like the rest.
    assert not cuda["torch_memory_saver"].optional and cuda["torch_memory_saver"].required_on("cuda")
    assert all(c.required_on("cuda") for c in cuda.values())
    # vLLM's own CUDA requirements, read from its sdist where the test environment cached it.
    cache = os.environ.get("VERL_PATCHES_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "verl_patches")
    sdist = os.path.join(cache, f"vllm-{base['vllm'].version}.tar.gz")
    if not os.path.isfile(sdist):
        return
    with tarfile.open(sdist) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith("requirements/cuda.txt"))
        text = tf.extractfile(member).read().decode()
    pins = {Requirement(line.split("#")[0].strip()).name: Requirement(line.split("#")[0].strip())
            for line in text.splitlines() if "==" in line.split("#")[0]}
    for name in ("torch", "torchaudio", "torchvision", "xformers"):
        assert str(pins[name].specifier) == f"=={cuda[name].version}", name


def test_the_lock_can_be_chosen_by_the_environment(monkeypatch):
    from verl_patches.core.lock import CUDA_LOCK_PATH, LOCK_ENV

    monkeypatch.setenv(LOCK_ENV, str(CUDA_LOCK_PATH))
    assert load_lock()["torch"].version == load_lock(CUDA_LOCK_PATH)["torch"].version
    monkeypatch.delenv(LOCK_ENV)
    assert "torch_npu" in load_lock()
