"""``python -m verl_patches preflight``: rehearse whole train/rollout switches and verify them.

Locally it spawns ``--nproc`` processes; under torchrun (RANK/WORLD_SIZE set, one process per
die) it runs in place, which is how it runs across the cluster before a real job.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from verl_patches.core.lock import REPO_ROOT
from verl_patches.config.settings import BUCKET_MB, METHODS, TOOL_BUCKET_MB_HIGH, TOOL_BUCKET_MB_LOW
from verl_patches.base import atomic, accelerator
from verl_patches.base.schema import Integer, Number, PathArg, Text, parse_args as schema_parse
from verl_patches.base import env as overlay_env
from verl_patches.launch.local_ranks import run_distributed
from verl_patches.launch.procs import Terminated
from verl_patches.reshard.hf_check import LogitCheckError, assemble, check_logits, reference, to_hf
from verl_patches.preflight.switch_rehearsal import Options, rehearse
from verl_patches.reshard.weight_sync import plan_summaries
from verl_patches.reshard.layouts import RolloutLayout, TrainLayout
from verl_patches.reshard.model import LayoutError, ModelConfig
from verl_patches.reshard.placements import build_placements
from verl_patches.reshard.planner import build_plan
from verl_patches.reshard.shards import torch_dtype
import torch
import torch.distributed as dist

MODELS = {"tiny": REPO_ROOT / "configs" / "model" / "tiny_deepseek_v3.json",
          "deepseek_v3": REPO_ROOT / "configs" / "model" / "deepseek_v3.json"}
# Default layouts per process count for the tiny model (4 layers, the first dense): training
# uses TP, uneven PP and EP where the count allows, rollout TP + DP with EP over the instance.
DEFAULT_LAYOUTS = {
    8: ("tp=2,pp=2,ep=2,layers=1,3", "tp=2,dp=4"),
    4: ("tp=2,pp=2,ep=1,layers=1,3", "tp=1,dp=4"),
    2: ("tp=1,pp=2,ep=1,layers=1,3", "tp=1,dp=2"),
    1: ("tp=1,pp=1,ep=1", "tp=1,dp=1"),
}
REFERENCE_LAYOUTS = [("tp=4,pp=8,ep=8,layers=7,7,8,8,8,8,8,7", "tp=2,dp=128"),
                     ("tp=4,pp=8,ep=8,layers=7,7,8,8,8,8,8,7", "tp=2,dp=64,instances=2")]
METHOD_NAMES = {"direct": "ours (direct)", "alltoallv": "B (alltoallv)", "upstream": "A (upstream)"}
# Device memory may differ by allocator rounding and collective bookkeeping between steps
# (under 1 MiB seen on H200 with a 38 GB model, both signs); a leaked weight is far larger.
LEAK_TOLERANCE = 2 << 20
# Models up to this many parameters are gathered on rank 0 for the logit check and the dump.
GATHER_LIMIT = 50_000_000


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.2f}"


DUMP_MANIFEST = "manifest.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verl_patches preflight", description=__doc__)
    p.add_argument("--nproc", type=Integer(low=1, high=4096, env="WORLD_SIZE"), default=None,
                   help="local processes to spawn (default 8); under torchrun it must equal WORLD_SIZE")
    p.add_argument("--backend", choices=("gloo", "nccl", "hccl"), default="gloo")
    p.add_argument("--model", type=Text(), default="tiny", help="tiny | deepseek_v3 | PATH to a HF config.json")
    p.add_argument("--train", type=Text(), default=None, help="e.g. tp=2,pp=2,ep=2,layers=1,3")
    p.add_argument("--rollout", type=Text(), default=None, help="e.g. tp=2,dp=4[,instances=1]")
    p.add_argument("--method", default="all", choices=(*METHODS, "all"))
    p.add_argument("--steps", type=Integer(low=1, high=10_000), default=2,
                   help="switch iterations per method (>= 2 to check leaks)")
    p.add_argument("--seed", type=Integer(low=0, high=2 ** 32 - 1), default=0)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--bucket-mb", type=Number(low=TOOL_BUCKET_MB_LOW, high=TOOL_BUCKET_MB_HIGH),
                   default=float(BUCKET_MB),
                   help="the reshard's transfer bucket, MiB: what one rank sends plus receives in one collective")
    p.add_argument("--copy-chunk-mb", type=Number(low=0, low_open=True, high=1 << 20), default=64.0,
                   help="the offload engine's copy chunk, MiB (before issue 38 --bucket-mb set it too)")
    p.add_argument("--kv-mb", type=Number(low=0, high=1 << 20), default=16.0,
                   help="size of the simulated KV cache per rank")
    p.add_argument("--dump", type=PathArg("output directory"), default=None,
                   help="write rollout shards + reference model here (replaced whole: an earlier dump's files go)")
    p.add_argument("--json", type=PathArg("output file"), default=None, help="write the results as JSON here")
    p.add_argument("--no-plan", action="store_true", help="skip the 256-die reference plan figures")
    p.add_argument("--graph-check", action="store_true",
                   help="CUDA (nccl): keep the rollout weights and KV cache in address-stable regions, capture a "
                        "CUDA graph of a forward over them at the first switch, and require every later replay to "
                        "equal the eager forward bit for bit at unchanged addresses")
    p.add_argument("--heartbeat-timeout", type=Number(low=0, low_open=True, high=86400.0,
                                                      env="VERL_PATCHES_HEARTBEAT_TIMEOUT_S",
                                                      doc="0 would switch the liveness check off"),
                   default=None, metavar="S",
                   help="a local rank silent this many seconds (stopped, stuck) is named and the run ends "
                        "(default: VERL_PATCHES_HEARTBEAT_TIMEOUT_S, else 120)")
    p.add_argument("--corrupt", type=Text(), default=None, help=argparse.SUPPRESS)  # RANK:PARAM:METHOD fault injection
    return p


def dump_foreign(root: Path) -> list[str]:
    """Entries of an existing ``--dump`` directory that an earlier preflight dump did not write (its
    manifest lists its files): such a directory is not replaced."""
    if not root.is_dir():
        return []
    names = sorted(e.name for e in root.iterdir())
    try:
        listed = set(json.loads((root / DUMP_MANIFEST).read_text())["written"]) if names else set()
    except (OSError, ValueError, KeyError, TypeError):
        return names
    return [n for n in names if n != DUMP_MANIFEST and n not in listed]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    a = schema_parse(p, argv)
    if a.graph_check and a.backend != "nccl":
        p.error("--graph-check captures CUDA graphs: it needs --backend nccl")
    # Where results go is checked now, not after the whole rehearsal has run.
    if a.json is not None:
        if a.json.is_dir():
            p.error(f"--json {a.json}: expected a file path, it is a directory")
        why = atomic.writable_dir(a.json.parent)
        if why:
            p.error(f"--json {a.json}: {why}")
    if a.dump is not None:
        if a.dump.exists() and not a.dump.is_dir():
            p.error(f"--dump {a.dump}: expected a directory path")
        foreign = dump_foreign(a.dump)
        if foreign:
            p.error(f"--dump {a.dump} holds files an earlier preflight dump did not write ({', '.join(foreign[:5])}"
                    f"{' ...' if len(foreign) > 5 else ''}); the dump replaces its directory whole: choose an "
                    "empty or new directory")
        why = atomic.writable_dir(a.dump.parent)
        if why:
            p.error(f"--dump {a.dump}: {why}")
    return a


def backend_problem(backend: str) -> str | None:
    """Why ``--backend`` cannot run here (its device package absent, no device), or None."""
    if backend == "hccl":
        if importlib.util.find_spec("torch_npu") is None:
            return ("--backend hccl runs on Ascend NPUs through torch_npu, which is not installed in this Python; "
                    "install torch_npu (CANN), or use --backend gloo (CPU) or nccl (CUDA)")
    elif backend == "nccl":
        if not torch.cuda.is_available():
            return ("--backend nccl runs on CUDA devices, and torch finds none here (torch.cuda.is_available() is "
                    f"False; torch {torch.__version__}); use --backend gloo (CPU) or hccl (Ascend NPU)")
    return None


class PreflightInputError(ValueError):
    """An argument, model config or layout the rehearsal cannot run with; found before any rank starts."""


class PreflightOutputError(OSError):
    """A result file or the dump could not be written; nothing half-written is left in its place."""


def _load_model(spec: str) -> tuple[dict[str, Any], str]:
    path = MODELS.get(spec, Path(spec))
    if not Path(path).is_file():
        raise PreflightInputError(f"model config {spec!r} not found (tiny, deepseek_v3, or a config.json path)")
    try:
        model = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PreflightInputError(f"model config {path}: not readable JSON ({e})") from None
    if not isinstance(model, dict):
        raise PreflightInputError(f"model config {path}: expected a JSON object, got {type(model).__name__}")
    return model, str(path)


def _options(a: argparse.Namespace, world: int) -> Any:
    model, _ = _load_model(a.model)
    train, rollout = a.train, a.rollout
    if train is None or rollout is None:
        if world not in DEFAULT_LAYOUTS or a.model != "tiny":
            raise PreflightInputError(f"give --train and --rollout for {world} processes and model {a.model!r} "
                                      f"(defaults exist for the tiny model on {sorted(DEFAULT_LAYOUTS)} processes)")
        dt, dr = DEFAULT_LAYOUTS[world]
        train, rollout = train or dt, rollout or dr
    corrupt = None
    if a.corrupt:
        try:
            r, name, m = a.corrupt.split(":")
            corrupt = (int(r), name, m)
        except ValueError:
            raise PreflightInputError(f"--corrupt {a.corrupt!r}: expected RANK:PARAM:METHOD") from None
    methods = METHODS if a.method == "all" else (a.method,)
    check_layouts(model, train, rollout, world)
    n_params = _count_params(model)
    return Options(model=model, train=train, rollout=rollout, methods=methods, steps=a.steps, seed=a.seed,
                   dtype=a.dtype, bucket_mb=a.bucket_mb, copy_chunk_mb=a.copy_chunk_mb, kv_mb=a.kv_mb, corrupt=corrupt,
                   gather_shards=n_params <= GATHER_LIMIT, graph_check=a.graph_check)


def check_layouts(model: dict[str, Any], train: str, rollout: str, world: int) -> None:
    """Every layout rule the ranks would apply, checked here so that a mistake costs no process."""
    try:
        P = build_placements(ModelConfig.from_hf(model), TrainLayout.parse(train), RolloutLayout.parse(rollout))
    except (LayoutError, TypeError, ValueError) as e:
        raise PreflightInputError(f"--train {train!r} / --rollout {rollout!r}: {e}") from None
    if P.world != world:
        raise PreflightInputError(f"--rollout {rollout!r} spans {P.world} ranks but {world} processes would run "
                                  f"(--nproc, or WORLD_SIZE under torchrun)")


def _count_params(model: dict[str, Any]) -> int:
    P = build_placements(ModelConfig.from_hf(model), TrainLayout(1, 1, 1, (), 1, True), RolloutLayout(1, 1))
    return sum(t.numel for t in P.tensors)


def _rank_entry(rank: int, world: int, opts: Any) -> dict[str, Any]:
    return rehearse(rank, world, opts)


# -- aggregation and report ------------------------------------------------------------------

def aggregate(results: list[dict[str, Any]], opts: Any) -> dict[str, Any]:
    methods: dict[str, Any] = {}
    for m in opts.methods:
        per_rank = [r["methods"][m] for r in results]
        steps = len(per_rank[0]["steps"])
        recv = [[pr["steps"][s]["recv_bytes"] for pr in per_rank] for s in range(steps)]
        secs = [max(pr["steps"][s]["seconds"] for pr in per_rank) for s in range(steps)]
        phases = list(dict.fromkeys(k for pr in per_rank for k in pr["phase_seconds"]))  # schedule order
        methods[m] = {
            "method": m,
            # The last step is the steady state (the first one also sets up communicators).
            "reshard_seconds_last": secs[-1],
            "reshard_seconds_median": statistics.median(secs),
            "reshard_seconds_per_step": secs,
            "max_recv_bytes": max(max(r) for r in recv),
            "mean_recv_bytes": sum(sum(r) for r in recv) / (steps * len(results)),
            "link_bytes_per_step": sum(recv[-1]),
            "collectives": max(pr["steps"][-1]["collectives"] for pr in per_rank),
            "peak_extra_bytes": max(max(s["peak_extra_bytes"] for s in pr["steps"]) for pr in per_rank),
            "ledger_peak_bytes_max_rank": max(pr["ledger_peak"] for pr in per_rank),
            "ledger_peak_step": per_rank[0]["ledger_peak_step"],
            "phase_seconds": {k: max(pr["phase_seconds"].get(k, 0.0) for pr in per_rank) for k in phases},
            "mismatches": [x for pr in per_rank for x in pr["mismatches"]],
            "graph_replays": min(pr.get("graph_replays", 0) for pr in per_rank),
        }
    leaks = []
    for r in results:
        for m, mem in r["memory"].items():
            a, b = mem["after_first"], mem["after_last"]
            if b["device_allocated"] - a["device_allocated"] > LEAK_TOLERANCE:
                leaks.append(f"rank {r['rank']} {m}: device memory {a['device_allocated']} -> {b['device_allocated']}")
            if b["host_pool_bytes"] != a["host_pool_bytes"] or b["host_allocations"] != a["host_allocations"]:
                leaks.append(f"rank {r['rank']} {m}: host buffer pool grew after the first step "
                             f"({a['host_pool_bytes']} -> {b['host_pool_bytes']} bytes)")
    return {"methods": methods, "leaks": leaks}


def render(report: dict[str, Any]) -> str:
    lines = []
    ms = report["methods"]
    lines.append(f"{'method':<16}{'reshard s*':>11}{'recv max MiB':>14}{'recv mean MiB':>15}{'link MiB':>11}"
                 f"{'collectives':>13}{'extra MiB':>11}{'ledger peak MiB':>17}  check")
    for m, r in ms.items():
        ok = "ok" if not r["mismatches"] else f"{len(r['mismatches'])} WRONG"
        lines.append(f"{METHOD_NAMES[m]:<16}{r['reshard_seconds_last']:>11.4f}{_mib(r['max_recv_bytes']):>14}"
                     f"{_mib(r['mean_recv_bytes']):>15}{_mib(r['link_bytes_per_step']):>11}{r['collectives']:>13}"
                     f"{_mib(r['peak_extra_bytes']):>11}{_mib(r['ledger_peak_bytes_max_rank']):>17}  {ok}")
    lines.append("* reshard s: the last step's time, slowest rank (the first step also sets up communicators)")
    lines.append("")
    phases = list(next(iter(ms.values()))["phase_seconds"])
    lines.append("seconds per switch phase (slowest rank, mean over steps):")
    lines.append(f"{'phase':<26}" + "".join(f"{METHOD_NAMES[m]:>16}" for m in ms))
    for ph in phases:
        lines.append(f"{ph:<26}" + "".join(f"{ms[m]['phase_seconds'].get(ph, 0.0):>16.4f}" for m in ms))
    return "\n".join(lines)


def reference_plans(model_path: Path) -> list[dict[str, Any]]:
    out = []
    for train, rollout in REFERENCE_LAYOUTS:
        plan = build_plan(str(model_path), train, rollout)
        out.append({"train": train, "rollout": rollout, "methods": plan_summaries(plan)})
    return out


def render_plans(plans: list[dict[str, Any]]) -> str:
    lines = ["reshard plan for DeepSeek-V3 671B on 256 dies (configs/model/deepseek_v3.json, bf16):"]
    for p in plans:
        lines.append(f"  train {p['train']}  ->  rollout {p['rollout']}")
        for s in p["methods"]:
            lines.append(f"    {METHOD_NAMES[s['method']]:<16} recv max {s['max_recv_bytes'] / 1e9:9.2f} GB/rank  "
                         f"mean {s['mean_recv_bytes'] / 1e9:9.2f} GB  links {s['total_link_bytes'] / 1e12:8.2f} TB  "
                         f"collectives {s['collectives']:>6}  extra {s['peak_extra_bytes'] / 1e9:7.2f} GB")
    return "\n".join(lines)


def _finish(a: argparse.Namespace, opts: Any, results: list[dict[str, Any]], elapsed: float) -> int:
    report = aggregate(results, opts)
    print(render(report))
    failures = [f"rank {x['rank']}, parameter {x['param']}, method {x['method']}, step {x['step']}: "
                f"{x['elements_wrong']} element(s) differ from the expected rollout shard"
                if x["param"] != "<graph replay>" else
                f"rank {x['rank']}, method {x['method']}, step {x['step']}: the captured graph's replay differs from "
                f"the eager forward in {x['elements_wrong']} element(s); moved since capture: {x['moved'] or 'none'}"
                for m in report["methods"].values() for x in m["mismatches"]]
    logit = None
    if opts.gather_shards and not failures:
        logit = _logit_check(opts, results)
    elif not opts.gather_shards:
        print("\nlogit check skipped: the model is too large to gather on one rank")
    if a.dump:
        _dump(a.dump, opts, results)
    plans = None
    if not a.no_plan and MODELS["deepseek_v3"].is_file():
        plans = reference_plans(MODELS["deepseek_v3"])
        print("\n" + render_plans(plans))
    failures += report["leaks"]
    if isinstance(logit, str):
        failures.append(logit)
    if a.json:
        write_json(a.json, {"options": {k: v for k, v in opts.__dict__.items() if k != "model"}, "world": len(results),
                            "elapsed_seconds": elapsed, "report": report, "logit_check": logit,
                            "reference_plans": plans, "failures": failures})
    if failures:
        print("\nPREFLIGHT FAILED:", file=sys.stderr)
        for f in failures:
            print(f"  - {f}", file=sys.stderr)
        return 1
    graphs = ""
    if opts.graph_check:
        graphs = (f", graph replay == eager at unchanged addresses after every switch "
                  f"({min(m['graph_replays'] for m in report['methods'].values())} checks per rank and method)")
    print(f"\npreflight passed: {len(results)} ranks, methods {', '.join(opts.methods)}, {opts.steps} step(s) "
          f"each, every rollout shard bit-exact, device memory growth <= {LEAK_TOLERANCE >> 20} MiB, host buffer pool "
          f"unchanged{graphs} ({elapsed:.1f} s)")
    return 0


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """The results file, whole or not at all (an earlier one stays as it was on failure)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, json.dumps(payload, indent=2, default=str))
    except OSError as e:
        raise PreflightOutputError(f"--json {path}: cannot write the results: {e.strerror or e} (nothing was left "
                                   "in its place)") from None


def _logit_check(opts: Any, results: list[dict[str, Any]]) -> Any:
    P = build_placements(ModelConfig.from_hf(opts.model), TrainLayout.parse(opts.train),
                         RolloutLayout.parse(opts.rollout))
    dtype = torch_dtype(opts.dtype)
    m = opts.methods[0]
    step = results[0]["shards"][m]["step"]
    variants = {"reference": to_hf(P, reference(P, seed=opts.seed, step=step, dtype=dtype))}
    for side in ("train", "rollout"):
        storages = {r["rank"]: r["shards"][m][side] for r in results}
        variants[f"{side} shards"] = to_hf(P, assemble(P, side, storages, dtype))
    try:
        info = check_logits(opts.model, P, variants, seed=opts.seed)
    except LogitCheckError as e:
        return f"logit check: {e}"
    print(f"\nlogit check: transformers DeepseekV3 built from the training shards and from the rollout shards "
          f"({info['parameters']} parameters) gives the reference model's logits exactly")
    return info


def _dump(root: Path, opts: Any, results: list[dict[str, Any]]) -> None:
    """The rollout shards, the reference model and a manifest listing them, written into a fresh
    directory that then replaces ``root`` whole: no file of an earlier dump stays beside them."""
    # Lazy: safetensors only when an HF checkpoint is written.
    from safetensors.torch import save_file

    if not opts.gather_shards:
        print("dump skipped: the model is too large to gather on one rank")
        return
    foreign = dump_foreign(root)
    if foreign:
        raise PreflightOutputError(f"--dump {root} holds files an earlier preflight dump did not write "
                                   f"({', '.join(foreign[:5])}); choose an empty or new directory")
    m = opts.methods[0]
    step = results[0]["shards"][m]["step"]
    try:
        with atomic.replace_dir(root) as tmp:
            written = []
            for r in results:
                name = f"rollout_rank{r['rank']:05d}.safetensors"
                save_file({k: v.contiguous() for k, v in r["shards"][m]["rollout"].items()}, str(tmp / name))
                written.append(name)
            P = build_placements(ModelConfig.from_hf(opts.model), TrainLayout.parse(opts.train),
                                 RolloutLayout.parse(opts.rollout))
            ref = to_hf(P, reference(P, seed=opts.seed, step=step, dtype=torch_dtype(opts.dtype)))
            save_file({k: v.contiguous() for k, v in ref.items()}, str(tmp / "reference_model.safetensors"))
            written.append("reference_model.safetensors")
            manifest = {"train_layout": opts.train, "rollout_layout": opts.rollout, "method": m, "seed": opts.seed,
                        "step": step, "dtype": opts.dtype, "world": len(results), "model_config": opts.model,
                        "files": {"reference": "reference_model.safetensors (HF names)",
                                  "rollout": "rollout_rank<RANK>.safetensors (vLLM 0.9.1 names, per rank)"},
                        "written": written}
            (tmp / DUMP_MANIFEST).write_text(json.dumps(manifest, indent=2))
    except OSError as e:
        raise PreflightOutputError(f"--dump {root}: cannot write the dump: {e.strerror or e} ({root} was left as "
                                   "it was)") from None
    print(f"dumped {len(results)} rollout shard files, the reference model and manifest.json to {root}")


def main(argv: list[str]) -> int:
    try:
        return _main(argv)
    except PreflightInputError as e:
        print(f"preflight: error: {e}", file=sys.stderr)
        return 2
    except PreflightOutputError as e:
        print(f"preflight: error: {e}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError) as e:
        # A rank failed, hung or stopped answering (run_distributed names it); the module is imported by
        # then (not before: --help imports no torch).
        launch = sys.modules.get("verl_patches.launch.local_ranks")
        if isinstance(e, TimeoutError) or (launch is not None and isinstance(e, launch.DistributedFailure)):
            print(f"preflight FAILED: {e}", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt:
        print("preflight: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"preflight: {e}; every rank was stopped", file=sys.stderr)
        return e.exit_code


def _main(argv: list[str]) -> int:
    a = parse_args(argv)
    # megatron-core wraps fused ops in torch.compile at import; torch then pre-forks a pool of
    # inductor compile workers in every rank. Preflight compiles nothing: one thread, no pool.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if a.backend == "hccl":
        os.environ.setdefault("VERL_PATCHES_DEVICE", "npu")
    elif a.backend == "nccl":
        os.environ.setdefault("VERL_PATCHES_DEVICE", "cuda")
    else:
        os.environ.setdefault("VERL_PATCHES_DEVICE", "cpu")
    problem = backend_problem(a.backend)
    if problem:
        raise PreflightInputError(problem)
    t0 = time.perf_counter()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ:
        return _main_torchrun(a, t0)
    world = 8 if a.nproc is None else a.nproc
    opts = _options(a, world)
    print(f"preflight: {world} local processes, backend {a.backend}, model {a.model}, "
          f"train {opts.train}, rollout {opts.rollout}, methods {', '.join(opts.methods)}, steps {opts.steps}",
          flush=True)

    heartbeat = a.heartbeat_timeout or overlay_env.get("VERL_PATCHES_HEARTBEAT_TIMEOUT_S")
    # The ranks left waiting in a collective for a stopped one get as long as the heartbeat (at most 30 s).
    results = run_distributed(_rank_entry, world, opts, backend=a.backend,
                              env={"VERL_PATCHES_DEVICE": os.environ["VERL_PATCHES_DEVICE"]}, timeout=3600,
                              heartbeat=heartbeat, grace=min(30.0, heartbeat))
    return _finish(a, opts, results, time.perf_counter() - t0)


def _main_torchrun(a: argparse.Namespace, t0: float) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.nproc is not None and a.nproc != world:  # parse_args refuses it already; kept for callers of this function
        raise PreflightInputError(f"--nproc {a.nproc} and WORLD_SIZE={world} disagree: under torchrun the launcher "
                                  "sets the process count; drop --nproc or give the same value")
    accelerator.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(a.backend)
    opts = _options(a, world)
    res = _rank_entry(rank, world, opts)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(res, gathered, dst=0)
    code = _finish(a, opts, gathered, time.perf_counter() - t0) if rank == 0 else 0
    dist.destroy_process_group()
    return code
