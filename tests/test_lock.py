"""The upstream lock is the one source of versions: requirements, setup script and the environment agree."""

import re

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
