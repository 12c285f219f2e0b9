"""verl_patches/base/env.py: one table of every VERL_PATCHES_* variable, one typed reader used by
every reader, errors naming the variable, settings that would weaken a check refused, and the
doctor reporting what is set (and nothing when nothing is)."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import REPO, cli, run_py
from verl_patches.base import env

NAME_RE = re.compile(r"VERL_PATCHES_[A-Z0-9_]*[A-Z0-9]")
# Readers in directories outside this change's scope still read os.environ themselves; each keeps
# its own check naming the variable (offload/stable.py, rollout/dp_domain.py) or is listed here
# to move onto env.get (offload/pool.py, reshard/copyops.py).
NOT_YET_ON_ENV = {"verl_patches/offload/pool.py", "verl_patches/offload/stable.py",
                  "verl_patches/reshard/copyops.py", "verl_patches/rollout/dp_domain.py"}


def _sources():
    for path in sorted((REPO / "verl_patches").rglob("*.py")) + sorted((REPO / "scripts").rglob("*.sh")):
        yield path.relative_to(REPO).as_posix(), path.read_text(encoding="utf-8")


def test_the_table_names_every_variable_the_overlay_reads_and_only_those():
    used = {m for _, text in _sources() for m in NAME_RE.findall(text)} - {"VERL_PATCHES_"}
    assert used == set(env.BY_NAME), (used ^ set(env.BY_NAME))
    for var in env.VARIABLES:
        for reader in var.read_by.split(", "):
            assert var.name in (REPO / reader).read_text(encoding="utf-8"), (var.name, reader)


def test_every_python_reader_goes_through_env():
    direct = re.compile(r"(os\.environ\.get|os\.getenv|environ\)?\.get)\(\s*(\"VERL_PATCHES_|[A-Z_]*ENV\b)")
    found = sorted(rel for rel, text in _sources() if rel.endswith(".py") and rel != "verl_patches/base/env.py"
                   and direct.search(text))
    assert set(found) <= NOT_YET_ON_ENV, set(found) - NOT_YET_ON_ENV


def test_choices_agree_with_the_readers():
    from verl_patches.base.accelerator import DEVICE_TYPES
    from verl_patches.core.record import PHASES
    from verl_patches.offload.stable import CHOICES

    assert env.BY_NAME["VERL_PATCHES_DEVICE"].choices == DEVICE_TYPES
    assert env.BY_NAME["VERL_PATCHES_PHASE"].choices == PHASES
    assert set(env.BY_NAME["VERL_PATCHES_STABLE_MEMORY"].choices) == set(CHOICES)


@pytest.mark.parametrize("raw, message", [
    ("0", "refused: a timeout of 0 or less would score every answer"),
    ("-1", "refused"),
    ("abc", "expected a finite number"),
    ("nan", "expected a finite number"),
    ("inf", "expected a finite number"),
    ("1e9", "<= 3600"),
])
def test_reward_timeout_is_checked_where_it_is_read(raw, message):
    r = run_py("import verl_patches.reward.deepscaler", env={"VERL_PATCHES_REWARD_TIMEOUT_S": raw})
    assert r.returncode != 0
    assert f"VERL_PATCHES_REWARD_TIMEOUT_S={raw!r}" in r.stderr and message in r.stderr, r.stderr
    assert "EnvError" in r.stderr


def test_reward_timeout_value_is_used():
    r = run_py("import verl_patches.reward.deepscaler as D; print(D.CHECK_TIMEOUT_S)",
               env={"VERL_PATCHES_REWARD_TIMEOUT_S": " 7.5 "})
    assert r.returncode == 0 and r.stdout.strip() == "7.5", r.stderr


@pytest.mark.parametrize("name, raw, want", [
    ("VERL_PATCHES_OFF", "TRUE", True), ("VERL_PATCHES_OFF", "0", False), ("VERL_PATCHES_OFF", "", False),
    ("VERL_PATCHES_DP_SYNC_ON_DEVICE", "off", False), ("VERL_PATCHES_DP_SYNC_ON_DEVICE", "", True),
    ("VERL_PATCHES_DISABLE", "a, b,,", ("a", "b")), ("VERL_PATCHES_DEVICE", " CPU ", "cpu"),
    ("VERL_PATCHES_OFFLOAD_HOST_RESERVE_GB", "0", 0.0), ("VERL_PATCHES_VLLM_DP_DOMAIN", '{"a": 1}', {"a": 1}),
])
def test_values(name, raw, want):
    assert env.get(name, {name: raw}) == want


@pytest.mark.parametrize("name, raw", [
    ("VERL_PATCHES_OFF", "2"), ("VERL_PATCHES_FIXED_ROUTING", "yes please"), ("VERL_PATCHES_DEVICE", "tpu"),
    ("VERL_PATCHES_PHASE", "trainer"), ("VERL_PATCHES_OFFLOAD_HOST_RESERVE_GB", "-1"),
    ("VERL_PATCHES_DISABLE", "a b"), ("VERL_PATCHES_VLLM_DP_DOMAIN", "[1]"), ("VERL_PATCHES_VLLM_DP_DOMAIN", "{"),
])
def test_bad_values_name_the_variable(name, raw):
    with pytest.raises(env.EnvError, match=re.escape(f"{name}={raw!r}: expected")):
        env.get(name, {name: raw})


def test_readers_use_the_table(monkeypatch):
    from verl_patches.base import accelerator
    from verl_patches.train import fixed_routing
    from verl_patches import prelude
    from verl_patches.core.phase import current_phase

    monkeypatch.setenv("VERL_PATCHES_DEVICE", "tpu")
    with pytest.raises(env.EnvError, match="VERL_PATCHES_DEVICE='tpu'"):
        accelerator.device_type()
    monkeypatch.setenv("VERL_PATCHES_PHASE", "trainer")
    with pytest.raises(env.EnvError, match="VERL_PATCHES_PHASE='trainer'"):
        current_phase()
    monkeypatch.setenv("VERL_PATCHES_FIXED_ROUTING", "true")
    assert fixed_routing.enabled() is True
    monkeypatch.setenv("VERL_PATCHES_OFF", "yes")
    assert prelude.apply_prelude("driver") == []


def test_nothing_set_nothing_reported():
    from verl_patches.core.doctor import env_findings

    assert env.settings({"PATH": "/bin", "VERL_PATCHES": "x"}) == [] and env_findings({}) == []
    # Set but empty is set (and means the default): reported, valid.
    assert [(s.name, s.ok) for s in env.settings({"VERL_PATCHES_REWARD_TIMEOUT_S": ""})] == [
        ("VERL_PATCHES_REWARD_TIMEOUT_S", True)]


def test_doctor_reports_set_variables_and_fails_on_invalid_ones():
    r = cli("doctor", env={"VERL_PATCHES_REWARD_TIMEOUT_S": "0", "VERL_PATCHES_DEVICE": "cpu"})
    assert r.returncode == 1
    assert "invalid          env:VERL_PATCHES_REWARD_TIMEOUT_S" in r.stdout and "refused" in r.stdout
    assert "ok               env:VERL_PATCHES_DEVICE" in r.stdout
    assert "1 invalid environment setting(s): env:VERL_PATCHES_REWARD_TIMEOUT_S" in r.stderr
    r = cli("doctor", "--json", env={"VERL_PATCHES_REWARD_TIMEUOT_S": "5"})
    rows = json.loads(r.stdout)
    assert r.returncode == 1 and rows[0]["id"] == "env:VERL_PATCHES_REWARD_TIMEUOT_S"
    assert "not a variable the overlay reads" in rows[0]["detail"]


@pytest.mark.slow
def test_doctor_lists_a_valid_setting_after_the_findings():
    # (Other tests may leave VERL_PATCHES_DEVICE in this process's environment: compared without env rows.)
    base = cli("doctor", "--json", env={"VERL_PATCHES_DEVICE": ""})
    r = cli("doctor", "--json", env={"VERL_PATCHES_DEVICE": "cpu"})
    rows, base_rows = json.loads(r.stdout), json.loads(base.stdout)
    findings = [x for x in rows if not x["id"].startswith("env:")]
    assert r.returncode == base.returncode and findings == [x for x in base_rows if not x["id"].startswith("env:")]
    env_rows = rows[len(findings):]  # after the findings: every env row (the tests set others, e.g. RANK_START)
    assert all(x["id"].startswith("env:") for x in env_rows)
    assert {"id": "env:VERL_PATCHES_DEVICE", "status": "ok"}.items() <= next(
        x for x in env_rows if x["id"] == "env:VERL_PATCHES_DEVICE").items()


def test_the_readme_lists_every_variable():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(VERL_PATCHES_[A-Z0-9_]+)` \|", text, flags=re.M)
    assert rows == [v.name for v in env.VARIABLES]


@pytest.mark.parametrize("name, raw, read", [
    ("VERL_PATCHES_OFFLOAD_HOST_RESERVE_GB", "lots", "from verl_patches.offload.pool import _default_reserve as f; f()"),
    ("VERL_PATCHES_OFFLOAD_HOST_RESERVE_GB", "-2", "from verl_patches.offload.pool import _default_reserve as f; f()"),
    ("VERL_PATCHES_STABLE_MEMORY", "cumem", "from verl_patches.offload.stable import select; select('cpu')"),
    ("VERL_PATCHES_RESHARD_TRITON", "nope", "from verl_patches.reshard.copyops import _kernel; _kernel.cache_clear(); _kernel()"),
    ("VERL_PATCHES_FINGERPRINT_TRITON", "nope",
     "from verl_patches.reshard.checksum import _fused_kernel; _fused_kernel.cache_clear(); _fused_kernel()"),
])
def test_engine_readers_use_the_table(monkeypatch, name, raw, read):
    """The offload pool, the stable-memory choice and the reshard kernel switch read through env.get: a bad
    value is an EnvError naming the variable, not a float() ValueError or a silent default."""
    monkeypatch.setenv(name, raw)
    with pytest.raises(env.EnvError, match=re.escape(f"{name}={raw!r}: expected")):
        exec(read, {})


def test_host_reserve_value_is_used(monkeypatch):
    from verl_patches.offload.pool import GiB, _default_reserve

    monkeypatch.setenv("VERL_PATCHES_OFFLOAD_HOST_RESERVE_GB", "1.5")
    assert _default_reserve() == int(1.5 * GiB)


def test_the_doctor_says_when_a_setting_weakens_a_check():
    r = cli("doctor", env={"VERL_PATCHES_DISABLE": "some.patch"})
    line = next(ln for ln in r.stdout.splitlines() if "env:VERL_PATCHES_DISABLE" in ln)
    assert "WEAKENS: the named patches, and the checks they carry, are off" in r.stdout, r.stdout
    assert line.split()[0] == "ok", line
    assert [s.weakens for s in env.settings({"VERL_PATCHES_DISABLE": ""})] == [None]
