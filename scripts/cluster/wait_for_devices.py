"""Wait until a Ray cluster reports the expected number of devices (all nodes joined), or time out.

Used by scripts/cluster/bringup.sh on the head; exits 0 when ready, 3 on timeout with what did join.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path

# The overlay's process helpers, from this checkout (bringup.sh also puts it on PYTHONPATH).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from verl_patches.launch.procs import alive  # noqa: E402


def _reachable(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=max(timeout, 0.01)):
            return True
    except OSError:
        return False


def head_gone(args: argparse.Namespace) -> str | None:
    """The error to report when the watched Ray head process (--head-pid) has exited, with its log's tail."""
    if args.head_pid is None or alive(args.head_pid):
        return None
    tail = ""
    if args.head_log:
        try:
            with open(args.head_log, errors="replace") as f:
                lines = f.read().splitlines()[-args.tail_lines:]
            tail = f"; {args.head_log} ends with:\n" + "\n".join(f"  | {ln}" for ln in lines)
        except OSError as e:
            tail = f"; its log {args.head_log} is not readable ({e})"
    return (f"error: the Ray head process (pid {args.head_pid}) exited while waiting for the cluster at {args.address}"
            f" (a port in use, a bad flag, a crash: see its log){tail}")


def _wait(args: argparse.Namespace, deadline: float, result: list[int]) -> None:
    """The Ray part; runs in a daemon thread because ray.init and Ray's queries can block
    in native code for far longer than any timeout of ours (e.g. a port that accepts but
    never speaks GCS)."""
    import ray

    while True:
        try:
            ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
            break
        except Exception as e:  # noqa: BLE001 - ray raises several types while the GCS starts
            if time.monotonic() > deadline:
                print(f"error: could not connect to the Ray head at {args.address} within {args.timeout:.0f} s: {e}",
                      file=sys.stderr)
                result.append(3)
                return
            time.sleep(args.interval)
    have, alive = 0.0, []
    try:
        while True:
            have = ray.cluster_resources().get(args.resource, 0.0)
            alive = [n for n in ray.nodes() if n.get("Alive")]
            if have >= args.expected and len(alive) >= args.nodes:
                print(f"ready: {len(alive)} node(s), {have:g} {args.resource} (expected {args.expected:g})", flush=True)
                result.append(0)
                return
            if time.monotonic() > deadline:
                break
            time.sleep(args.interval)
    finally:
        ray.shutdown()
    joined = ", ".join(f"{n.get('NodeManagerAddress')}={n.get('Resources', {}).get(args.resource, 0):g}" for n in alive)
    print(f"error: after {args.timeout:.0f} s only {len(alive)} of {args.nodes} node(s) and {have:g} of "
          f"{args.expected:g} {args.resource} joined the cluster at {args.address} (joined: {joined or 'none'}). "
          "Check that every worker ran the launcher with the same MASTER_ADDR/RAY_PORT and DEVICES_PER_NODE.",
          file=sys.stderr)
    result.append(3)


def main(argv: list[str] | None = None) -> int:
    from verl_patches.base.schema import Integer, Number, Text
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--address", type=Text(), required=True, help="ray head address host:port")
    p.add_argument("--resource", type=Text(), required=True, help="resource name: NPU, GPU or CPU")
    p.add_argument("--expected", type=Number(low=0, low_open=True), required=True, help="total count across the cluster")
    p.add_argument("--nodes", type=Integer(low=1), required=True, help="expected number of alive nodes")
    p.add_argument("--timeout", type=Number(low=0, low_open=True), default=600.0)
    p.add_argument("--interval", type=Number(low=0, low_open=True), default=2.0)
    p.add_argument("--head-pid", type=Integer(low=1), default=None,
                   help="the Ray head's process on this node: if it exits, stop waiting at once and say so")
    p.add_argument("--head-log", type=Text(), default=None, help="the Ray head's log, whose end is shown when it exits")
    p.add_argument("--tail-lines", type=Integer(low=0), default=20)
    args = p.parse_args(argv)
    host, _, port = args.address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        p.error(f"--address must be host:port, got {args.address!r}")
    if not args.timeout > 0 or not args.interval > 0:
        p.error("--timeout and --interval must be positive")

    deadline = time.monotonic() + args.timeout

    def stop_if_head_gone() -> None:
        gone = head_gone(args)
        if gone:
            print(gone, file=sys.stderr)
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(3)  # the Ray thread may be blocked in native code

    # The head may still be coming up: wait for its port first, within the deadline.
    while not _reachable(host, int(port), min(args.interval, deadline - time.monotonic())):
        stop_if_head_gone()
        if time.monotonic() >= deadline:
            print(f"error: the Ray head at {args.address} was not reachable within {args.timeout:.0f} s "
                  "(is MASTER_ADDR/RAY_PORT right, and the head started?)", file=sys.stderr)
            return 3
        time.sleep(min(args.interval, max(deadline - time.monotonic(), 0)))
    result: list[int] = []
    worker = threading.Thread(target=_wait, args=(args, deadline, result), daemon=True)
    worker.start()
    # Ray's own calls get their share of the deadline plus a grace to report; then we stop waiting.
    # Meanwhile the head's process is watched: one that exited (a busy port: another program answers
    # there) is reported at once with its log, not after the whole timeout as a silent port.
    end = deadline + args.interval + 2
    while worker.is_alive() and time.monotonic() < end:
        worker.join(min(0.5, max(end - time.monotonic(), 0)))
        if not result:
            stop_if_head_gone()
    if result:
        return result[0]
    print(f"error: no answer from the Ray head at {args.address} within {args.timeout:.0f} s: its port accepts "
          "connections but Ray does not respond", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(3)  # the Ray thread is blocked in native code; an orderly exit would wait for it


if __name__ == "__main__":
    sys.exit(main())
