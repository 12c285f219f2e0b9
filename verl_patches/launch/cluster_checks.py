"""The launchers' checks of their inputs: ONE function each, called by the dry run and by the real
bring-up alike (scripts/cluster/launch.sh), so both reject the same things with the same message.

``python -m verl_patches.launch.cluster_checks env``: the values every node reads (ports, ranks, counts,
timeouts, DEVICE, LAUNCH_CONSOLE and the overlay's own ``VERL_PATCHES_*`` variables, verl_patches/base/env.py);
a setting that weakens a check is refused (a timeout of 0, fault injection outside the test launcher) or,
where it is the user's explicit choice (VERL_PATCHES_OFF, VERL_PATCHES_DISABLE), said as a warning.
``python -m verl_patches.launch.cluster_checks head [--ckpt DIR]``: what only the head reads: its Ray port
free, the model's config.json, the data files and, for a real-weight run, a complete checkpoint of
the model that config.json describes (its embedding shape and its layer count).
Each prints one ``error: ...`` line per problem on stderr and exits 2 when there is one.

This module imports only the standard library and verl_patches.base.env at import time (the launcher
runs it before it knows whether its Python has anything else); the checkpoint check reads the
torch_dist index, so it imports torch (the launcher has checked for it by then).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import pickle
import re
import socket
import sys
from pathlib import Path
from typing import Mapping

from verl_patches.base import env as overlay_env
from verl_patches.reporting.findings import finish
from verl_patches.base.schema import Text
from verl_patches.tools import check_ckpt

POSITIVE_INTS = ("NNODES", "DEVICES_PER_NODE", "WAIT_TIMEOUT_S", "STOP_GRACE_S")
CHOICES = {"DEVICE": ("npu", "cuda", "cpu", "npu-rehearsal"), "ROLE": ("head", "worker"), "LAUNCH_CONSOLE": ("full", "steps")}
# The defaults of scripts/cluster/bringup.sh, for a caller that did not set them.
DEFAULTS = {"NNODES": "16", "DEVICES_PER_NODE": "16", "WAIT_TIMEOUT_S": "900", "STOP_GRACE_S": "15",
            "RAY_PORT": "6379", "DEVICE": "npu", "LAUNCH_CONSOLE": "full"}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
EMBEDDING = "embedding.word_embeddings.weight"


def _val(environ: Mapping[str, str], name: str) -> str:
    # As the launcher's ${NAME:-default}: empty is unset.
    return environ.get(name) or DEFAULTS.get(name, "")


def env_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """Every value of the launcher's environment the real run would fail on (or be silently wrong with)."""
    env = os.environ if environ is None else environ
    out = []
    for name in POSITIVE_INTS:
        # A timeout or grace of 0 would switch the wait off: refused with the counts.
        if not re.fullmatch(r"[1-9][0-9]*", _val(env, name)):
            out.append(f"{name} must be a positive integer, got {_val(env, name)!r}")
    port = _val(env, "RAY_PORT")
    if not re.fullmatch(r"[1-9][0-9]*", port) or int(port) > 65535:
        out.append(f"RAY_PORT must be a TCP port, a whole number from 1 to 65535, got {port!r}")
    for name, allowed in CHOICES.items():
        v = _val(env, name)
        if (v or name != "ROLE") and v not in allowed:
            out.append(f"{name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {v!r}")
    rank = env.get("NODE_RANK", "")
    if rank:
        nnodes = _val(env, "NNODES")
        if not re.fullmatch(r"0|[1-9][0-9]*", rank):
            out.append(f"NODE_RANK must be a whole number from 0 (the head) to NNODES-1, got {rank!r}")
        elif nnodes.isdigit() and int(rank) >= int(nnodes):
            out.append(f"NODE_RANK must be a whole number from 0 (the head) to NNODES-1 = {int(nnodes) - 1}, "
                       f"got {rank!r}")
    # The overlay's own variables: the table's reader (an unknown name, a bad value, or one that weakens a check).
    out += [s.detail for s in overlay_env.settings(env) if not s.ok]
    fault = env.get("VERL_PATCHES_INJECT_FAULT", "").strip()
    if fault and env.get("LAUNCH_ALLOW_FAULT_INJECTION") != "1":
        out.append(f"VERL_PATCHES_INJECT_FAULT={fault!r} corrupts rollout weights on purpose (a test of the weight "
                   "fingerprint) and is never for a real run: unset it (scripts/train_tiny.sh is the launcher for "
                   "fault-injection runs)")
    return out


def env_warnings(environ: Mapping[str, str] | None = None) -> list[str]:
    """Allowed settings that switch a check or a fix off: said on every run, dry or not, so that a weakened
    run is never mistaken for a checked one."""
    env = os.environ if environ is None else environ
    return [f"{s.name}={s.raw!r} weakens the run: {s.weakens}" for s in overlay_env.settings(env) if s.ok and s.weakens]


def port_problem(addr: str, port: int) -> str | None:
    """Whether something already listens on ``addr:port`` (a stale Ray head, another program). Only an
    address of this machine is tried; SO_REUSEADDR, so connections in TIME_WAIT do not count."""
    s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return (f"RAY_PORT={port} is already in use on MASTER_ADDR={addr} (a Ray head still running, or another "
                    "program): the Ray head could not listen there; stop what holds it or choose another RAY_PORT")
        return None  # not an address of this machine, or not one we may bind: Ray reports that itself
    finally:
        s.close()
    return None


def model_config(model_path: str) -> tuple[dict | None, str | None]:
    """(config, None) from MODEL_PATH/config.json, or (None, the problem)."""
    f = Path(os.path.expanduser(model_path)) / "config.json"
    if not f.is_file():
        return None, f"MODEL_PATH={model_path} has no config.json (HF model directory with config and tokenizer)"
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"MODEL_PATH={model_path}: config.json is not readable JSON ({e})"
    if not isinstance(cfg, dict):
        return None, f"MODEL_PATH={model_path}: config.json is not a JSON object"
    return cfg, None


def ckpt_shape_problems(ckpt: Path, cfg: dict, model_path: str) -> list[str]:
    """Whether the checkpoint holds the model ``cfg`` describes: the embedding's (vocab_size, hidden_size)
    and num_hidden_layers decoder layers, from the torch_dist index (.metadata; no tensor is read)."""
    with open(Path(ckpt) / ".metadata", "rb") as f:
        md = pickle.load(f)
    sizes = {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    layers = {int(m.group(1)) for k in md.state_dict_metadata for m in [_LAYER.match(k)] if m}
    where = f"DIST_CKPT_PATH={ckpt} does not hold the model of MODEL_PATH={model_path}/config.json"
    out = []
    want = (cfg.get("vocab_size"), cfg.get("hidden_size"))
    if EMBEDDING not in sizes:
        out.append(f"{where}: it has no {EMBEDDING}")
    elif sizes[EMBEDDING] != want:
        out.append(f"{where}: its {EMBEDDING} is {sizes[EMBEDDING]}, the config gives (vocab_size, hidden_size) = {want}")
    n = cfg.get("num_hidden_layers")
    have = max(layers) + 1 if layers else 0
    if have != n or len(layers) != have:
        gaps = sorted(set(range(have)) - layers)
        out.append(f"{where}: it holds {len(layers)} decoder layer(s) (indices up to {have - 1}"
                   f"{', missing ' + str(gaps[:5]) if gaps else ''}), the config gives num_hidden_layers = {n}")
    return out


def head_problems(environ: Mapping[str, str] | None = None, ckpt: str | None = None) -> tuple[list[str], list[str]]:
    """(problems, lines of what was found good) for what the head reads before anything starts: its Ray
    port, then the shared inputs (``shared_problems``)."""
    env = os.environ if environ is None else environ
    out = []
    port = _val(env, "RAY_PORT")
    if env.get("MASTER_ADDR") and port.isdigit() and 0 < int(port) < 65536:
        p = port_problem(env["MASTER_ADDR"], int(port))
        if p:
            out.append(p)
    found, good = shared_problems(env, ckpt)
    return out + found, good


def shared_problems(environ: Mapping[str, str] | None = None, ckpt: str | None = None) -> tuple[list[str], list[str]]:
    """(problems, good lines) for the inputs every node reads (the model's config.json, the data files,
    the checkpoint and its model size): the head and every worker check them alike, with one message."""
    env = os.environ if environ is None else environ
    out: list[str] = []
    good: list[str] = []
    model_path = env.get("MODEL_PATH", "")
    cfg, why = model_config(model_path)
    if why:
        out.append(why)
    for name in ("TRAIN_FILES", "VAL_FILES"):
        f = env.get(name, "")
        if not Path(os.path.expanduser(f)).is_file():
            out.append(f"data file not found: {name}={f} (python -m verl_patches.data.prepare deepscaler "
                       "--input ... --out-dir ...)")
    if ckpt:
        found, summary = check_ckpt.problems(Path(ckpt))
        out += found
        if not found:
            shape = ckpt_shape_problems(Path(ckpt), cfg, model_path) if cfg is not None else []
            out += shape
            if not shape:
                good.append(f"{ckpt}: complete torch_dist checkpoint ({summary})"
                            + (f" of the model of {model_path}/config.json" if cfg is not None else ""))
    return out, good


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches.launch.cluster_checks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("env", "head", "worker"),
                   help="env: every node's values; head: the head's inputs; worker: the inputs a worker shares with "
                        "the head (model, data, checkpoint)")
    p.add_argument("--ckpt", type=Text(), default=None, help="the real-weight run's checkpoint (DIST_CKPT_PATH)")
    args = p.parse_args(argv)
    if args.what == "env":
        return finish(env_problems(), code=2, warnings=env_warnings())
    found, good = (head_problems if args.what == "head" else shared_problems)(ckpt=args.ckpt)
    return finish(found, code=2, lines=good)


if __name__ == "__main__":
    sys.exit(main())
