"""Every script under scripts/ is run by CI on a tiny setting, so none can rot between the runs that
use it for real (a benchmark on a GPU machine, a launcher on the cluster).

SCRIPTS names, for each script, the test that runs it; the first test keeps that list complete. Every
script also answers --help with exit 0 and usage text before it starts any work (the HELP_* lists name
the exceptions and why).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import time
import sys

import pytest

from tests.helpers import REPO

SCRIPTS = {
    "scripts/bench_dp_sync.py": "tests/test_scripts.py::test_bench_dp_sync_tiny",
    "scripts/bench_offload.py": "tests/offload/test_bench_offload_script.py::test_bench_offload_tiny",
    "scripts/bench_optimizer_offload.py": "tests/test_scripts.py::test_bench_optimizer_offload_tiny",
    "scripts/bench_host_optimizer_step.py": "tests/test_scripts.py::test_bench_host_optimizer_step_tiny",
    "scripts/bench_reshard.py": "tests/test_scripts.py::test_bench_reshard_tiny",
    "scripts/bench_self_check.py": "tests/test_scripts.py::test_bench_self_check_tiny",
    "scripts/bench_fp8_quant.py": "tests/test_scripts.py::test_bench_fp8_quant_tiny",
    "scripts/measure_tensorcache_bytes.py": "tests/test_scripts.py::test_measure_tensorcache_bytes_tiny",
    "scripts/fetch_sdist.py": "scripts/setup_test_env.sh (fetches vLLM's sdist for every CI run)",
    "scripts/setup_test_env.sh": "scripts/test.sh (CI's command)",
    "scripts/test.sh": ".ci/run",
    "scripts/install_upstream_sources.sh": "tests/test_lock.py::test_install_upstream_sources_picks_each_archive_checks_its_sha_and_else_skips_with_a_note",
    "scripts/preflight.sh": "tests/preflight/test_preflight.py::test_default_preflight_passes_and_ours_receives_least",
    "scripts/rehearse_multinode.sh": "tests/recipe/test_multinode_rehearsal.py::test_two_nodes_train_like_one_and_leave_nothing",
    "scripts/train_tiny.sh": "tests/recipe/test_train_tiny.py::test_the_run_logs_every_step_without_nan_and_ends_with_a_summary",
    "scripts/train_deepseekv3_256die_true_weight.sh": "tests/recipe/test_launchers.py::test_true_weight_dry_run_composes_and_validates",
    "scripts/train_deepseekv3_256die_random_init.sh": "tests/recipe/test_launchers.py::test_random_init_dry_run_env_overrides_and_layout_error",
    "scripts/train_deepseekv3_128gpu_random_init.sh": "tests/recipe/test_launchers.py::test_the_nvidia_launcher_dry_run_composes_and_validates_with_the_cuda_lock",
    "scripts/train_deepseekv3_128gpu_true_weight.sh": "tests/recipe/test_launchers.py::test_the_nvidia_true_weight_launcher_dry_run",
    "scripts/cluster/bringup.sh": "tests/recipe/test_launchers.py::test_single_node_ray_bringup_and_teardown",
    "scripts/cluster/launch.sh": "tests/recipe/test_launchers.py::test_single_node_ray_bringup_and_teardown",
    "scripts/cluster/recipe_env.sh": "tests/recipe/test_env.py",
    "scripts/cluster/wait_for_devices.py": "tests/recipe/test_wait_for_devices.py",
}


def _scripts() -> set[str]:
    return {str(p.relative_to(REPO)) for p in (REPO / "scripts").rglob("*")
            if p.is_file() and p.suffix in (".sh", ".py") and "__pycache__" not in p.parts}


def test_every_script_is_run_by_a_named_test():
    assert _scripts() == set(SCRIPTS), ("scripts without a test that runs them, or entries for gone scripts: "
                                        f"{sorted(_scripts() ^ set(SCRIPTS))}")
    for script, where in SCRIPTS.items():
        target = where.split(" ", 1)[0]
        path, _, name = target.partition("::")
        text = (REPO / path).read_text()
        assert not name or f"def {name}(" in text, f"{script}: {target} does not exist"
        assert os.path.basename(script) in text or name, f"{script}: {path} does not run it"


# --help: exit 0 with usage text, before any work. Scripts that do not yet, and why (never run here:
# their --help would start that work).
HELP_NOT_RUN: dict[str, str] = {}
# Fails today without starting work (run, strict: fixing it must remove the entry).
HELP_FAILS: dict[str, str] = {}
# Their module imports torch (and verl) before argparse runs: seconds each, so the slow tier.
HELP_SLOW = {"scripts/bench_offload.py", "scripts/bench_reshard.py", "scripts/measure_tensorcache_bytes.py"}


def _help_cases():
    for script in sorted(SCRIPTS):
        if script in HELP_NOT_RUN:
            continue
        marks = [pytest.mark.slow] if script in HELP_SLOW else []
        if script in HELP_FAILS:
            marks.append(pytest.mark.xfail(strict=True, reason=HELP_FAILS[script]))
        yield pytest.param(script, marks=marks, id=script.removeprefix("scripts/"))


def test_the_help_lists_name_only_scripts():
    assert set(HELP_NOT_RUN) | set(HELP_FAILS) | HELP_SLOW <= set(SCRIPTS)
    assert not set(HELP_NOT_RUN) & set(HELP_FAILS)


@pytest.mark.parametrize("script", list(_help_cases()))
def test_help_exits_0_with_usage_before_any_work(script, tmp_path):
    # A VENV that does not exist: a script that set up its environment before reading --help would
    # start building it there (and time out); the working directory must stay empty.
    venv = tmp_path / "venv"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cmd = [sys.executable if script.endswith(".py") else "bash", str(REPO / script), "--help"]
    r = subprocess.run(cmd, cwd=cwd, env=dict(os.environ, VENV=str(venv)), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert re.search(r"^usage: \S", r.stdout, re.M), r.stdout
    assert not venv.exists() and list(cwd.iterdir()) == []


@pytest.mark.slow
def test_bench_reshard_tiny(tmp_path):
    from verl_patches.base.ports import free_port_block

    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port_block(1, low=20000)), str(REPO / "scripts" / "bench_reshard.py"),
                        "--model", str(REPO / "configs" / "model" / "tiny_deepseek_v3.json"),
                        "--train", "tp=1,pp=2,ep=1", "--rollout", "tp=2,dp=1", "--layers", "2", "--experts", "4",
                        "--warmup", "0", "--repeats", "1", "--a2a-sizes-mb", "0.25,0.0625", "--a2a-repeats", "1",
                        "--methods", "direct,direct@3,upstream,alltoallv", "--json-out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {row["method"] for row in rows} == {"direct", "direct@3", "upstream", "alltoallv"}
    # The all-to-all curve, smallest size first; each row against its own size and against the best.
    assert [c["mib_per_rank"] for c in res["a2a_curve"]] == [0.0625, 0.25]
    assert all(c["busbw"] > 0 for c in res["a2a_curve"]) and res["a2a_peak_busbw"] == max(c["busbw"] for c in res["a2a_curve"])
    for row in rows:
        assert row["busbw_fraction_of_peak"] == pytest.approx(row["busbw"] / res["a2a_peak_busbw"])
        assert row["busbw_fraction"] == pytest.approx(row["busbw"] / row["a2a_busbw"])
        assert row["staged_busbw"] > 0
        assert row["busbw_fraction_of_staged"] == pytest.approx(row["busbw"] / row["staged_busbw"])
    assert "all_to_all_single bus bandwidth by per-rank message size" in r.stdout and "of peak" in r.stdout
    assert "staged ceiling" in r.stdout and "of staged" in r.stdout
    # Each method's result is checked against the same shards by the script itself.
    assert "transposing copy kernel equals torch copy_: True" in r.stdout
    assert all(" True" in line for line in r.stdout.splitlines() if line.startswith("tp1 pp2 ep1 -> tp2 dp1"))


@pytest.mark.slow
def test_bench_optimizer_offload_tiny(tmp_path):
    """On the CPU the device optimizer runs through the switch loop twice (the hybrid one needs a GPU and
    is listed as not run, with the reason); on a GPU the same command measures both (docs/benchmarks.md)."""
    out = tmp_path / "opt.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_optimizer_offload.py"), "--device", "cpu",
                        "--steps", "2", "--json-out", str(out)], capture_output=True, text=True, timeout=300,
                       cwd=str(REPO))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {row["variant"]: row for row in res["rows"]}
    assert rows["device"]["median_step_s"] > 0 and rows["device"]["optimizer_group_bytes"][0] > 0
    assert rows["device, again"]["rel_diff_vs_device"] == 0.0  # the host run repeats itself exactly
    assert "needs a GPU" in rows["host fraction 1"]["not_run"]
    assert res["info"]["model_params"] > 0
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_optimizer_offload.py"), "--fractions", "0"],
                         capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert bad.returncode == 2 and "--fractions must each be in (0, 1]" in bad.stderr


def test_bench_host_optimizer_step_tiny(tmp_path):
    """On the CPU: the host part of the step (fused AdamW over fp32 host params) in two processes on one
    core each, and the hybrid step recorded as not run; on a GPU the same script steps megatron-core's
    HybridDeviceOptimizer (docs/benchmarks.md)."""
    out = tmp_path / "host.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_host_optimizer_step.py"), "--device", "cpu",
                        "--params", "0.0002", "--tensor-m", "0.05", "--procs", "2", "--threads", "1", "--steps", "2",
                        "--json-out", str(out)], capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [row["index"] for row in res["rows"]] == [0, 1] and all(row["cores"] == 1 for row in res["rows"])
    assert all(row["params"] == 200000 and row["tensors"] == 4 and len(row["step_s"]) == 2 for row in res["rows"])
    assert res["median_step_s_max"] > 0 and "needs a GPU" in res["hybrid_not_run"]
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_host_optimizer_step.py"), "--params", "0"],
                         capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert bad.returncode == 2 and "argument --params: '0': expected a finite number > 0 and <= 64" in bad.stderr


def test_bench_self_check_tiny(tmp_path):
    out = tmp_path / "fp.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_self_check.py"), "--device", "cpu",
                        "--gib", "0.002", "--repeats", "1", "--model", "configs/model/tiny_deepseek_v3.json",
                        "--train", "tp=2,pp=2,ep=1,layers=3,1", "--rollout", "tp=2,dp=2",
                        "--entropy-tokens", "64", "--vocab-shard", "256", "--json-out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["paper"]["ranks"] == 4 and res["paper"]["shard_gb"] > 0
    assert all(res["measured"][f"{k}_gib_s"] > 0 for k in ("copy", "receive", "send", "receive_torch", "send_torch",
                                                           "receive_previous"))
    assert res["measured"]["same_integers"] is True and res["measured"]["fused"] is False  # a CPU: the torch path
    assert 0 < res["paper"]["checked_sent_gb"] and res["paper_torch"]["share"] > 0
    assert res["mismatch"]["entropy_gib_s"] > 0 and res["mismatch"]["paper_entropy_s"] > 0
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_self_check.py"), "--gib", "0"],
                         capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert bad.returncode == 2 and "argument --gib: '0': expected a finite number > 0 and <= 64" in bad.stderr


def test_bench_fp8_quant_tiny(tmp_path):
    out = tmp_path / "fp8.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_fp8_quant.py"), "--tiny", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {row["tensor"]: row for row in res["rows"]}
    assert rows["experts w13"]["shape"] == [16 // 4, 2 * 32, 64] and rows["q_b_proj"]["shape"] == [8 * 24 // 2, 48]
    assert all(row["copy_gb_s"] > 0 and row["torch_gb_s"] > 0 for row in rows.values())
    assert all(row["fused_s"] is None and row["bit_equal"] is None for row in rows.values())  # a CPU: torch only
    assert "| experts w2 | [4, 64, 32] |" in r.stdout and "fused not available here" in r.stdout
    assert rows["q_b_proj"]["tp_on_block_grid"] is False  # 96 rows per TP rank: a cut inside the first block
    # DeepSeek-V3 at the 128-GPU rollout layout (TP8, EP128): the per-GPU shapes the bench times by default.
    spec = importlib.util.spec_from_file_location("bench_fp8", REPO / "scripts" / "bench_fp8_quant.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = json.loads((REPO / "configs" / "model" / "deepseek_v3.json").read_text())
    assert bench.shapes(cfg, 8, 128) == {
        "experts w13": (2, 4096, 7168), "experts w2": (2, 7168, 2048), "q_a_proj": (1536, 7168),
        "q_b_proj": (3072, 1536), "kv_a_proj_with_mqa": (576, 7168), "kv_b_proj": (4096, 512),
        "o_proj": (7168, 2048)}
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_fp8_quant.py"), "--ep", "3"],
                         capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert bad.returncode == 2 and "--ep 3 does not divide the model's 256 routed experts" in bad.stderr


@pytest.mark.slow
def test_measure_tensorcache_bytes_tiny(tmp_path):
    out = tmp_path / "tc.json"
    # Two workers (TP1 x PP1 x DP2) on CI's 2 cores: the default eight took 215 s there; the saving is per DP chunk.
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "measure_tensorcache_bytes.py"), "--prompts", "8",
                        "--n", "2", "--prompt-len", "8", "--response-len", "8", "--tp", "1", "--pp", "1",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=400, cwd=str(REPO),
                       env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["identical_update_inputs"] is True and res["ratio"] > 1.0, res
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "measure_tensorcache_bytes.py"), "--prompts", "2"],
                         capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert bad.returncode == 2 and "--prompts 2 must be a multiple of the workers, TP2 x PP2 x DP2 = 8" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["cpu", "npu-rehearsal"])
def test_bench_dp_sync_tiny(tmp_path, platform):
    """Two ranks: every call on both groups and vLLM's own has_unfinished_dp, each answer checked against the
    ranks' shared inputs. cpu: both groups gloo; npu-rehearsal: the Ascend path (torch.npu, the hccl backend) on
    the declared torch_npu stand-in, whose hccl is gloo. On GPUs the device group is NCCL (docs/benchmarks.md)."""
    from verl_patches.base.ports import free_port_block

    out = tmp_path / "dp.json"
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PATCHES_DEVICE", "VERL_PATCHES_PLATFORM")}
    device = ["--device", "cpu"]
    if platform == "npu-rehearsal":
        env["VERL_PATCHES_PLATFORM"], device = "npu-rehearsal", []
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port_block(1, low=20000)), str(REPO / "scripts" / "bench_dp_sync.py"),
                        *device, "--steps", "5", "--warmup", "1", "--json-out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=str(REPO), env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["world"] == 2 and res["checked"] is True and res["vllm_not_run"] == ""
    backend = {"cpu": "gloo", "npu-rehearsal": "hccl"}[platform]
    assert res["backend"] == backend and res["device"]["device_type"] == platform.split("-")[0]
    assert {(row["path"], row["call"]) for row in res["rows"]} == {
        *((path, call) for path in ("gloo, CPU tensors (upstream)", f"{backend}, device tensors (recipe)")
          for call in ("any_unfinished", "tokens_across_dp", "agree_forward")),
        ("vLLM has_unfinished_dp, gloo (upstream code)", "any_unfinished")}
    assert all(0 < row["median_ms"] <= row["p90_ms"] for row in res["rows"])
    alone = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_dp_sync.py")], capture_output=True,
                           text=True, timeout=120, cwd=str(REPO), env={k: v for k, v in os.environ.items() if k != "RANK"})
    assert alone.returncode == 2 and "run it under torchrun" in alone.stderr


def test_bench_dp_sync_knows_every_answer_and_names_a_wrong_one():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_dp_sync", REPO / "scripts" / "bench_dp_sync.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ins = bench.inputs(0, 3, 4)
    assert ins == bench.inputs(0, 3, 4) and ins != bench.inputs(0, 4, 4)  # shared by the ranks, new each step
    want = bench.expected(ins)
    assert want["tokens_across_dp"] == [r["tokens"] for r in ins]
    assert want["agree_forward"][0] == [-(-r["tokens"] // 8) * 8 for r in ins]
    bench.check("p", 3, 1, "tokens_across_dp", list(want["tokens_across_dp"]), want["tokens_across_dp"])
    wrong = want["tokens_across_dp"][:]
    wrong[2] += 1
    with pytest.raises(bench.AgreementError, match=r"^p: step 3, rank 1: tokens_across_dp returned \["):
        bench.check("p", 3, 1, "tokens_across_dp", wrong, want["tokens_across_dp"])


def test_bench_self_checks_entropy_is_verls_at_tensor_parallel_1():
    # The bench times verl's entropy arithmetic without importing verl (the GPU image has none); here,
    # where verl is installed, the two agree on one gloo rank (megatron's TP group of 1).
    code = """
import importlib.util, os, torch, torch.distributed as dist
from verl_patches.base.ports import free_port_block
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port_block(1, low=20000)))
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as mpu
mpu.initialize_model_parallel(1, 1)
from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy
spec = importlib.util.spec_from_file_location("bench", "scripts/bench_self_check.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
x = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * 4
print("maxdiff", (vocab_parallel_entropy(x) - bench._entropy_tp1(x)).abs().max().item())
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-3000:]
    diff = float(r.stdout.split("maxdiff")[1])
    assert diff < 1e-5, diff  # float32 rounding of the same formula, summed in another order


def _hold_lock(path, seconds):
    """Hold the venv build's lock (flock, as the script takes it) from another process for ``seconds``."""
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(float(sys.argv[2]))")
    p = subprocess.Popen([sys.executable, "-c", code, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"  # readiness: the lock is taken before the script starts
    return p


def test_a_second_venv_build_waits_for_the_first(tmp_path):
    """Two builds of one venv are serialised: the second waits for the lock, then goes on (here to its Python
    check, which fails by name: nothing is built, nothing of the first build's is touched)."""
    venv = tmp_path / "venv"
    holder = _hold_lock(tmp_path / "venv.build.lock", 3)
    try:
        t0 = time.monotonic()
        r = subprocess.run(["bash", str(REPO / "scripts" / "setup_test_env.sh")], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "VENV": str(venv), "PYTHON": "no-such-python3.11"})
        waited = time.monotonic() - t0
    finally:
        holder.wait(timeout=60)
    assert f"waiting for another build of {venv}" in r.stderr, r.stderr
    assert waited >= 2.0, waited  # it did not go on while the lock was held
    assert r.returncode == 2 and "no-such-python3.11 not found" in r.stderr, r.stderr
    assert not venv.exists()


def test_a_venv_build_held_up_too_long_is_refused_by_name(tmp_path):
    venv = tmp_path / "venv"
    holder = _hold_lock(tmp_path / "venv.build.lock", 20)
    try:
        r = subprocess.run(["bash", str(REPO / "scripts" / "setup_test_env.sh")], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "VENV": str(venv), "PYTHON": "no-such-python3.11",
                                             "VERL_PATCHES_VENV_LOCK_WAIT_S": "1"})
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert r.returncode == 2
    assert f"another build of {venv} still holds {tmp_path / 'venv.build.lock'} after 1 s" in r.stderr, r.stderr
    assert not venv.exists()
    bad = subprocess.run(["bash", str(REPO / "scripts" / "setup_test_env.sh")], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "VENV": str(venv), "VERL_PATCHES_VENV_LOCK_WAIT_S": "soon"})
    assert bad.returncode == 2 and "VERL_PATCHES_VENV_LOCK_WAIT_S='soon'" in bad.stderr, bad.stderr
