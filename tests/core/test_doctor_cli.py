"""`python -m verl_patches doctor|patches|diff|docs|fingerprint` against the real installed upstream."""

import json
import re
import shutil

import pytest

from tests.helpers import REPO, cli


def test_doctor_strict_passes_in_the_test_environment():
    r = cli("doctor", "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verl.reward_score.deepscaler" in r.stdout


def test_doctor_json_shape():
    r = cli("doctor", "--strict", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert isinstance(rows, list) and rows
    for row in rows:
        assert {"id", "target", "status", "detail"} <= row.keys()
        assert row["status"] in ("ok", "missing", "changed", "version-mismatch")
    by_id = {r["id"]: r for r in rows}
    assert by_id["lock:verl"]["installed"] == "0.4.1"
    assert by_id["lock:vllm"]["status"] == "ok"  # 0.9.1+empty is release 0.9.1
    assert by_id["verl.reward_score.deepscaler"]["status"] == "ok"


@pytest.mark.parametrize("catalogue,status,patch_id", [
    ("fixture_wrong_fingerprint_catalogue", "changed", "fixture.wrong_fingerprint"),
    ("fixture_missing_target_catalogue", "missing", "fixture.missing_target"),
    ("fixture_wrong_version_catalogue", "version-mismatch", "fixture.wrong_version"),
])
@pytest.mark.slow
def test_doctor_fails_naming_the_patch(catalogue, status, patch_id):
    env = {"VERL_PATCHES_EXTRA_MODULES": catalogue}
    r = cli("doctor", "--strict", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    bad = [ln for ln in r.stdout.splitlines() if patch_id in ln]
    assert bad and bad[0].startswith(status), r.stdout
    rows = json.loads(cli("doctor", "--json", env=env).stdout)
    assert {r["id"]: r["status"] for r in rows}[patch_id] == status


@pytest.mark.slow
def test_doctor_on_a_copied_in_tree_detects_an_edited_target(tmp_path):
    """The README's layout: upstream packages copied next to the overlay, checked by --upstream-root."""
    import verl

    root = tmp_path / "upstream"
    shutil.copytree(verl.__path__[0], root / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    r = cli("doctor", "--upstream-root", str(root), "--json")
    rows = {r["id"]: r for r in json.loads(r.stdout)}
    assert rows["verl.reward_score.deepscaler"]["status"] == "ok"
    assert rows["lock:verl"]["detail"].endswith("(source tree)")
    assert rows["lock:verl"]["installed"] == "0.4.1"  # read from verl/version/version
    # Someone edits the upstream function body: the doctor must notice, without importing it.
    f = root / "verl" / "utils" / "reward_score" / "__init__.py"
    f.write_text(f.read_text().replace('if data_source == "openai/gsm8k":', 'if data_source == "gsm8k":'))
    r = cli("doctor", "--upstream-root", str(root))
    assert r.returncode == 1
    line = next(ln for ln in r.stdout.splitlines() if "verl.reward_score.deepscaler" in ln)
    assert line.startswith("changed") and str(f) in line


def test_patches_listing_and_json():
    r = cli("patches", "--json")
    assert r.returncode == 0
    rows = json.loads(r.stdout)
    ids = [p["id"] for p in rows]
    assert "verl.reward_score.deepscaler" in ids
    for p in rows:
        assert {"id", "target", "kind", "phases", "upstream", "versions", "fingerprint", "why", "remove_when",
                "feature", "requires", "after", "platforms", "upstream_lines"} <= p.keys()
        # The upstream lines come from the installed release: every target is found here (MindSpeed
        # only where its release archive was available: scripts/install_upstream_sources.sh).
        if not (p["upstream"] == "mindspeed" and p["upstream_lines"].endswith("(not installed here)")):
            assert re.fullmatch(r"\S+ \S+ \S+\.py#L\d+-L\d+", p["upstream_lines"]), p
    by_id = {p["id"]: p for p in rows}
    assert by_id["verl.old_log_prob.update_policy"]["requires"] == ["verl.old_log_prob.policy_loss",
                                                                   "verl.old_log_prob.minibatch",
                                                                   "verl.old_log_prob.micro_batch_check"]
    text = cli("patches").stdout
    assert any(ln.startswith("verl.old_log_prob.update_policy") and "old_log_prob_reuse" in ln and "requires" in ln
               for ln in text.splitlines())


def test_diff_shows_upstream_next_to_ours():
    r = cli("diff", "verl.reward_score.deepscaler")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("--- upstream verl.utils.reward_score:default_compute_score")
    assert "-    if data_source == \"openai/gsm8k\":" in r.stdout
    assert "+        if data_source in DEEPSCALER_SOURCES:" in r.stdout
    assert cli("diff", "no.such.patch").returncode == 2


def test_docs_are_generated_from_the_registry_and_not_stale():
    r = cli("docs", "--check")
    assert r.returncode == 0, "docs/PATCHES.md is stale: run `python -m verl_patches docs --write`\n" + r.stderr
    text = (REPO / "docs" / "PATCHES.md").read_text()
    assert "## verl.reward_score.deepscaler" in text and "remove when" in text


def test_docs_check_fails_when_registry_changes():
    r = cli("docs", "--check", env={"VERL_PATCHES_EXTRA_MODULES": "fixture_wrong_version_catalogue"})
    assert r.returncode == 1 and "stale" in r.stderr


def test_fingerprint_command_matches_the_record():
    from verl_patches.patches import get_patch

    p = get_patch("verl.reward_score.deepscaler")
    r = cli("fingerprint", p.target)
    assert r.returncode == 0 and f'source_sha="{p.fingerprint.source_sha}"' in r.stdout
    assert cli("fingerprint", "verl.utils.reward_score:nope").returncode == 1


@pytest.mark.slow
def test_cann_is_read_from_its_install_record(tmp_path):
    """No CANN here: a toolkit install record laid out as CANN writes it is found and compared."""
    home = tmp_path / "ascend-toolkit" / "latest"
    (home / "x86_64-linux").mkdir(parents=True)
    rows = {r["id"]: r for r in json.loads(cli("doctor", "--json", env={"ASCEND_TOOLKIT_HOME": str(home)}).stdout)}
    assert rows["lock:cann"]["status"] == "missing" and rows["lock:cann"]["required"] is False
    (home / "x86_64-linux" / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.2.RC1\n")
    rows = {r["id"]: r for r in json.loads(cli("doctor", "--json", env={"ASCEND_TOOLKIT_HOME": str(home)}).stdout)}
    assert rows["lock:cann"]["status"] == "ok" and rows["lock:cann"]["installed"] == "8.2.RC1"
    # On an NPU platform a missing CANN fails --strict.
    r = cli("doctor", "--strict", "--platform", "npu", env={"ASCEND_TOOLKIT_HOME": str(tmp_path / "nothing")})
    assert r.returncode == 1 and "lock:cann" in r.stdout


def test_npu_only_patch_is_skipped_off_ascend_but_still_fingerprinted():
    """A patch whose target needs torch_npu (vLLM-Ascend's model runner) is not applied on CPU
    or CUDA, and the doctor checks its fingerprint by parsing without requiring it here."""
    from verl_patches.patches import load_catalogue
    from verl_patches.prelude import patches_for

    npu_only = [p for p in load_catalogue() if p.platforms == ("npu",)]
    assert npu_only, "expected at least one NPU-only patch in the registry"
    pid = npu_only[0].id
    phase = npu_only[0].phases[0]
    assert pid not in [p.id for p in patches_for(phase, device_type="cpu")]
    assert pid in [p.id for p in patches_for(phase, device_type="npu")]
    rows = {r["id"]: r for r in json.loads(cli("doctor", "--json").stdout)}
    assert rows[pid]["status"] == "ok" and rows[pid]["required"] is False
    rows = {r["id"]: r for r in json.loads(cli("doctor", "--json", "--platform", "npu").stdout)}
    assert rows[pid]["required"] is True
    # The NPU platform's layer-spec finding: not resolved without torch_npu, failing through the lock's line only.
    spec = rows["layer-spec"]
    assert spec["status"] == "missing" and spec["upstream_absent"] and not spec["failed"], spec
    assert "torch_npu not importable here" in spec["detail"]
    assert rows["lock:torch_npu"]["failed"]


def test_the_doctor_in_a_python_without_the_stack_reports_it_missing(tmp_path):
    """A bare Python (site-packages off) holding only the overlay and its one dependency, packaging:
    the doctor reads the catalogue without importing torch or any upstream, and reports them absent."""
    import os
    import subprocess
    import sys

    import packaging

    site = tmp_path / "site"
    site.mkdir()
    (site / "packaging").symlink_to(packaging.__path__[0])
    r = subprocess.run([sys.executable, "-S", "-m", "verl_patches", "doctor", "--platform", "cpu"],
                       capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                       env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{site}"})
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any(ln.startswith("missing") and "lock:torch " in ln for ln in lines), r.stdout
    assert "doctor: " in r.stderr and "lock:torch" in r.stderr
