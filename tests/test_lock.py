"""The upstream lock is the one source of versions: requirements, setup script and the environment agree."""

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.helpers import REPO
from verl_patches.core.lock import load_extras, load_lock


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
    expected = {"verl", "vllm", "vllm_ascend", "megatron_core", "mindspeed", "mindspeed_llm", "megatron_training",
                "torch", "torch_npu", "cann", "transformers", "ray", "hydra_core"}
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


SOURCE_ONLY = {  # the lock's components with a release archive: the releases MindSpeed-LLM v2.2.0 pairs
    "mindspeed": ("v2.2.0_core_r0.12.1", "mindspeed", "0.12.1", "mindspeed"),
    "megatron_training": ("core_v0.12.1", "megatron-lm-training", "0.12.1", "megatron.training"),
    "mindspeed_llm": ("v2.2.0", "mindspeed_llm", "0.0.1", "mindspeed_llm"),
}


def test_the_source_only_components_are_pinned_to_their_release_tag_commit_and_archive():
    lock = load_lock()
    assert {k for k, c in lock.items() if c.archive} == set(SOURCE_ONLY)
    for key, (ref, package, version, import_name) in SOURCE_ONLY.items():
        c = lock[key]
        assert (c.ref, c.package, c.version, c.import_name) == (ref, package, version, import_name), key
        assert re.fullmatch(r"[0-9a-f]{40}", c.commit or "") and re.fullmatch(r"[0-9a-f]{64}", c.archive_sha256 or "")
        assert c.platforms == ("npu",) and c.install.startswith("source"), key
    # The installer names every one in the lock's order: MindSpeed before what builds on it.
    assert list(SOURCE_ONLY) == [k for k in lock if lock[k].archive]


def _sources(upstream_dir, script=REPO / "scripts" / "install_upstream_sources.sh", **env):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in dict(os.environ, **env).items() if v is not None}
    if upstream_dir is not None:
        env["VERL_PATCHES_UPSTREAM_DIR"] = str(upstream_dir)
    return subprocess.run(["bash", str(script), "--print", sys.executable], env=env, capture_output=True, text=True,
                          timeout=300)


def test_install_upstream_sources_picks_each_archive_checks_its_sha_and_else_skips_with_a_note(tmp_path):
    lock = load_lock()
    # GIT=false: the tag lookup fails as it does on a machine with registry access only.
    r = _sources(tmp_path, GIT="false")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"{k} skip: no {lock[k].archive} found (set VERL_PATCHES_UPSTREAM_DIR) and tag "
                                     f"{lock[k].ref} of {lock[k].repo} not reachable" for k in SOURCE_ONLY]
    assert str(tmp_path) not in r.stdout  # the stamp's lines name no place (a moved checkout keeps its venv)
    for key in SOURCE_ONLY:
        (tmp_path / lock[key].archive).write_bytes(b"not the release")
        r = _sources(tmp_path, GIT="false")
        assert r.returncode == 2 and "has sha256" in r.stderr and lock[key].archive_sha256 in r.stderr, key
        (tmp_path / lock[key].archive).unlink()


def test_install_upstream_sources_without_a_folder_named_looks_inside_and_beside_the_checkout(tmp_path):
    """No VERL_PATCHES_UPSTREAM_DIR: `upstream/` in the checkout wins over a sibling folder's `upstream/`."""
    import shutil

    archive = load_lock()["megatron_training"].archive
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    (checkout / "configs").mkdir()
    shutil.copy(REPO / "scripts" / "install_upstream_sources.sh", checkout / "scripts")
    shutil.copy(REPO / "configs" / "upstream.lock.toml", checkout / "configs")

    def source():
        return _sources(None, checkout / "scripts" / "install_upstream_sources.sh", GIT="false",
                        VERL_PATCHES_UPSTREAM_DIR=None)

    assert all(" skip: no " in line for line in source().stdout.splitlines())
    (tmp_path / "archives" / "upstream").mkdir(parents=True)
    (tmp_path / "archives" / "upstream" / archive).write_bytes(b"beside")
    r = source()  # found beside the checkout (and refused: not the release's bytes)
    assert r.returncode == 2 and str(tmp_path / "archives" / "upstream" / archive) in r.stderr
    (checkout / "upstream").mkdir()
    (checkout / "upstream" / archive).write_bytes(b"inside")
    r = source()
    assert r.returncode == 2 and f"checkout/upstream/{archive}" in r.stderr


def test_the_stamps_source_lines_name_the_archives_by_content_not_by_place(tmp_path):
    """setup_test_env.sh stamps its venv with install_upstream_sources.sh --print: the release archives
    found in two different folders give the same lines (sha256 and name), so a moved or linked checkout
    keeps its venv. Needs the release archives (in an upstream/ folder beside the checkout, as on CI)."""
    import shutil

    from verl_patches.core.lock import REPO_ROOT

    import os

    lock = load_lock()
    named = [Path(os.environ["VERL_PATCHES_UPSTREAM_DIR"])] if os.environ.get("VERL_PATCHES_UPSTREAM_DIR") else []
    folders = [*named, REPO_ROOT / "upstream", *REPO_ROOT.parent.glob("*/upstream")]
    found = {k: next((d / lock[k].archive for d in folders if (d / lock[k].archive).is_file()), None)
             for k in SOURCE_ONLY}
    if None in found.values():
        pytest.skip(f"not every release archive is beside or inside the checkout: {found}")
    outputs = []
    for where in ("a", "b/c"):
        (tmp_path / where).mkdir(parents=True)
        for path in found.values():
            shutil.copy(path, tmp_path / where / path.name)
        r = _sources(tmp_path / where, GIT="false")
        assert r.returncode == 0, r.stderr
        outputs.append(r.stdout.splitlines())
    assert outputs[0] == outputs[1] == [f"{k} archive sha256:{lock[k].archive_sha256} {lock[k].archive}"
                                        for k in SOURCE_ONLY]


def test_an_installed_tree_records_its_source_and_its_files(tmp_path, monkeypatch):
    """verl_patches/core/sources.py as the installer uses it for Megatron-LM's training package: the tree
    beside another distribution's folder of a namespace package, its RECORD checked file by file, its
    recorded source compared with the lock's, and the refusals (a namespace __init__.py, a file it does
    not own)."""
    import hashlib
    import io
    import tarfile

    from verl_patches.core import sources

    def archive(files):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tf:
            for name, data in files.items():
                info = tarfile.TarInfo(f"Repo-tag/{name}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        path = tmp_path / f"a{len(list(tmp_path.glob('a*.tar.gz')))}.tar.gz"
        path.write_bytes(buf.getvalue())
        return path, hashlib.sha256(buf.getvalue()).hexdigest()

    site = tmp_path / "site"
    (site / "pkgns" / "core").mkdir(parents=True)  # another distribution's part of the namespace
    monkeypatch.syspath_prepend(str(site))
    path, sha = archive({"pkgns/training/__init__.py": b"X = 1\n", "pkgns/training/data.h": b"//\n",
                         "LICENSE": b"license text\n", "other/skip.py": b""})
    url = {"url": path.as_uri(), "archive_info": {"hashes": {"sha256": sha}}}
    info = sources.install_tree(dist_name="pkgns-training", version="1.0", paths=["pkgns/training"],
                                direct_url=url, archive=path, site=site)
    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file() and info not in p.parents) \
        == ["pkgns/training/__init__.py", "pkgns/training/data.h"]
    assert (info / "licenses" / "LICENSE").read_text() == "license text\n"
    assert sources.source_problem("pkgns-training", sha, None) is None and sources.verify_record("pkgns-training") == []
    assert "the lock's is " + "0" * 64 in sources.source_problem("pkgns-training", "0" * 64, None)
    (site / "pkgns" / "training" / "__init__.py").write_text("X = 2\n")
    assert sources.verify_record("pkgns-training") == ["pkgns/training/__init__.py: content differs from the record"]
    with pytest.raises(FileExistsError, match="pip uninstall pkgns-training"):
        sources.install_tree(dist_name="pkgns-training", version="1.0", paths=["pkgns/training"], direct_url=url,
                             archive=path, site=site)
    bad, _ = archive({"pkgns/__init__.py": b"", "pkgns/legacy/x.py": b""})
    with pytest.raises(ValueError, match="namespace package"):
        sources.install_tree(dist_name="pkgns-legacy", version="1.0", paths=["pkgns/legacy", "pkgns/__init__.py"],
                             direct_url=url, archive=bad, site=site)
    # The doctor's verdict on a source-only component whose recorded source is not the lock's.
    from dataclasses import replace

    from verl_patches.core.doctor import check_component

    comp = replace(load_lock()["megatron_training"], package="pkgns-training", import_name="pkgns.training",
                   version="1.0")
    assert check_component(replace(comp, archive_sha256=sha), "npu", None).status == "ok"
    finding = check_component(comp, "npu", None)
    assert finding.status == "version-mismatch" and "install_upstream_sources.sh" in finding.detail


def test_the_doctor_imports_neither_mindspeed_llm_nor_megatron_training():
    """`import mindspeed_llm` runs MindSpeed-LLM's megatron adaptor (torch_npu, global megatron patches): the
    doctor reads the installed trees without importing them."""
    import subprocess
    import sys

    code = ("import runpy, sys\nsys.argv = ['verl_patches', 'doctor']\ntry:\n"
            "    runpy.run_module('verl_patches', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mindspeed_llm' or m.startswith('megatron.')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout[-2000:] + r.stderr[-2000:]


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
    assert not {"torch_npu", "cann", "vllm_ascend", "mindspeed", "mindspeed_llm", "megatron_training"} & cuda.keys()
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


TRACKERS = {"wandb", "swanlab", "mlflow"}  # verl 0.4.1's trainer.logger backends that need a package of their own


def test_the_trackers_extra_pins_verls_three_loggers_alike_in_the_lock_the_package_and_its_requirements_file():
    """The lock's [extras.trackers] names exactly wandb, swanlab and mlflow, each pinned to one release; the
    package's extra (pyproject.toml) and requirements-trackers.txt pin the same; none is in the required sets."""
    import tomllib

    from packaging.version import Version
    from verl.utils.tracking import Tracking

    extras = load_extras()
    assert set(extras) == {"trackers"}
    pins = extras["trackers"]
    assert set(pins) == TRACKERS and TRACKERS <= set(Tracking.supported_backend)
    assert all(not Version(v).is_prerelease and str(Version(v)) == v for v in pins.values()), pins
    expected = {name: f"=={version}" for name, version in pins.items()}
    package = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(package) == set(extras)
    assert {Requirement(r).name: str(Requirement(r).specifier) for r in package["trackers"]} == expected
    assert {name: str(r.specifier) for name, r in _requirements("requirements-trackers.txt").items()} == expected
    for path in ("requirements.txt", "requirements-test.txt"):
        assert not TRACKERS & set(_requirements(path)), path


def test_an_extra_pinned_to_no_version_is_refused(tmp_path):
    lock = tmp_path / "lock.toml"
    lock.write_text("[extras.trackers]\nwandb = 1\n")
    with pytest.raises(ValueError, match=r"\[extras.trackers\] pins must be version strings, got \{'wandb': 1\}"):
        load_extras(lock)
