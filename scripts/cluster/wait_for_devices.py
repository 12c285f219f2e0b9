"""Wait until a Ray cluster reports the expected number of devices (all nodes joined), or time out.

Used by scripts/cluster/bringup.sh on the head; exits 0 when ready, 3 on timeout with what did join.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--address", required=True, help="ray head address host:port")
    p.add_argument("--resource", required=True, help="resource name: NPU, GPU or CPU")
    p.add_argument("--expected", type=float, required=True, help="total count across the cluster")
    p.add_argument("--nodes", type=int, required=True, help="expected number of alive nodes")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--interval", type=float, default=2.0)
    args = p.parse_args(argv)

    import ray

    deadline = time.monotonic() + args.timeout
    # The head may still be coming up: retry the connection itself until the deadline.
    while True:
        try:
            ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
            break
        except Exception as e:  # noqa: BLE001 - ray raises several types while the GCS starts
            if time.monotonic() > deadline:
                print(f"error: could not connect to the Ray head at {args.address} within {args.timeout:.0f} s: {e}",
                      file=sys.stderr)
                return 3
            time.sleep(args.interval)
    have, alive = 0.0, []
    try:
        while True:
            have = ray.cluster_resources().get(args.resource, 0.0)
            alive = [n for n in ray.nodes() if n.get("Alive")]
            if have >= args.expected and len(alive) >= args.nodes:
                print(f"ready: {len(alive)} node(s), {have:g} {args.resource} (expected {args.expected:g})")
                return 0
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
    return 3


if __name__ == "__main__":
    sys.exit(main())
