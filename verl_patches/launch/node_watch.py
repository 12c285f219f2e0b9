"""The head launcher's node watch: while the trainer runs, every node that had joined must stay alive.

``python -m verl_patches.launch.node_watch --address HOST:PORT --nodes N --log LOG_DIR/trainer.log``
reads the node table from the Ray head's GCS every ``--interval`` seconds. When a node that was alive
is dead (its Ray killed: the GCS sees its raylet go within a few health checks) or gone silent (a
partition: it misses ``RAY_health_check_failure_threshold`` health checks of
``RAY_health_check_period_ms`` each), it prints one line naming the node (address, Ray node id), the
step the run was in (from the run report's ``step N/M`` lines in the trainer's log) and Ray's reason,
and exits 4; scripts/cluster/launch.sh then stops the trainer and everything it started.

Why the launcher and not the collectives' timeouts: a collective waiting on a silent peer (gloo, HCCL,
NCCL) waits for its communicator's timeout (30 minutes by default in torch), and verl's driver waits
on that collective. Ray's node health is independent of what the trainer is doing, so the stop comes
within ``period x threshold`` (plus one ``--interval``) of the loss, whatever the step is doing.
Standard library and Ray's GCS client only (no ``ray.init``: the watch is not a driver of the job).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from verl_patches.base.schema import Integer, Number, PathArg, Text

EXIT_NODE_LOST = 4
# The run report's line per step (verl_patches/reporting/report.py): "step N/M | ...", possibly after
# Ray's "(TaskRunner pid=...)" prefix and colour codes. Step 0 is the validation before training.
STEP_LINE = re.compile(r"(?:^|\s)step (\d+)/(\d+) \|")
# verl's trainer, before its first step (verl/trainer/ppo/ray_trainer.py): "Total training steps: M".
TOTAL_LINE = re.compile(r"Total training steps: (\d+)")


def last_step(log: Path | None) -> tuple[int, int | None]:
    """(last completed training step, total) from the report's lines in the trainer's log; (0, None) if none."""
    done, total = 0, None
    if log is None:
        return done, total
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return done, total
    for m in TOTAL_LINE.finditer(text):
        total = int(m.group(1))
    for m in STEP_LINE.finditer(text):
        done, total = int(m.group(1)), int(m.group(2))
    return done, total


def step_phrase(log: Path | None) -> str:
    done, total = last_step(log)
    if total is None:
        return "before the first training step finished"
    if done >= total:
        return f"after the last step ({total}/{total})"
    return f"during step {done + 1}/{total} (last completed step: {done})"


def _nodes(client, timeout: float) -> dict[str, tuple[str, bool, str]]:
    """node id (hex) -> (address, alive, Ray's reason when dead)."""
    out = {}
    for node_id, info in client.get_all_node_info(timeout=timeout).items():
        hex_id = node_id.hex() if hasattr(node_id, "hex") else str(node_id)
        alive = info.state == 0  # GcsNodeInfo.GcsNodeState.ALIVE
        reason = ""
        if not alive and info.HasField("death_info"):
            reason = info.death_info.reason_message or str(info.death_info.reason)
        out[hex_id] = (info.node_manager_address, alive, reason)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", type=Text(), required=True, help="the Ray head's GCS address host:port")
    p.add_argument("--nodes", type=Integer(low=1), required=True,
                   help="how many nodes joined (the launcher waited for them)")
    p.add_argument("--log", type=PathArg("input file"), default=None,
                   help="the trainer's log, for the step the loss happened in")
    p.add_argument("--interval", type=Number(low=0, low_open=True, high=3600), default=2.0,
                   help="seconds between two reads of the node table")
    p.add_argument("--rpc-timeout", type=Number(low=0, low_open=True, high=3600), default=10.0,
                   help="seconds one read of the node table may take")
    args = p.parse_args(argv)
    if args.nodes < 1 or not args.interval > 0 or not args.rpc_timeout > 0:
        p.error("--nodes, --interval and --rpc-timeout must be positive")
    # Lazy: Ray's GCS client after the arguments are checked (a bad option fails without importing Ray).
    from ray._raylet import GcsClient

    client = GcsClient(address=args.address)
    watched: dict[str, str] = {}
    failures = 0
    while True:
        try:
            nodes = _nodes(client, args.rpc_timeout)
            failures = 0
        except Exception as e:  # noqa: BLE001 - the head's own exit is the launcher's to report
            failures += 1
            if failures * args.interval > 60:
                print(f"error: node watch: the Ray head at {args.address} has not answered for "
                      f"{failures * args.interval:.0f} s ({e})", file=sys.stderr, flush=True)
                return EXIT_NODE_LOST
            time.sleep(args.interval)
            continue
        if not watched:
            watched = {nid: addr for nid, (addr, alive, _) in nodes.items() if alive}
            if len(watched) < args.nodes:
                print(f"error: node watch: only {len(watched)} of {args.nodes} node(s) alive at its start: "
                      + ", ".join(sorted(watched.values())), file=sys.stderr, flush=True)
                return EXIT_NODE_LOST
            print(f"node watch: {len(watched)} node(s): " + ", ".join(
                f"{addr} ({nid[:12]})" for nid, addr in sorted(watched.items(), key=lambda kv: kv[1])), flush=True)
        lost = [(nid, addr) for nid, addr in watched.items() if nid not in nodes or not nodes[nid][1]]
        if lost:
            where = step_phrase(args.log)
            for nid, addr in lost:
                reason = nodes.get(nid, ("", False, "no longer in the node table"))[2] or "no reason given"
                print(f"error: node {addr} (Ray node {nid[:12]}) lost {where}: {reason}. Stopping the run; "
                      "relaunch on every node once the node is back (or without it, with NNODES lowered)",
                      file=sys.stderr, flush=True)
            return EXIT_NODE_LOST
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
