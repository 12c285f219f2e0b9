"""A multi-node rehearsal on one machine: separate network hosts made with ``ip netns`` (root only).

``python -m verl_patches.launch.netns_cluster OUT [--nodes 2] [--fault kill-ray|partition] [HYDRA_OVERRIDE ...]``
(scripts/rehearse_multinode.sh) makes one network namespace per node and one for the switch, joins
them by veth pairs to a bridge in the switch's namespace, gives the nodes the addresses
``SUBNET.1`` (the head), ``SUBNET.2``, ... inside their namespaces only (nothing is added to this
machine's own network), and runs ``scripts/train_tiny.sh`` in each namespace as a user runs the
launcher on each node of a cluster: ``MASTER_ADDR`` (the head's address), ``NODE_RANK``, ``NNODES``,
``DEVICES_PER_NODE``. Each node's launcher output goes to ``OUT/nodeR/console.log`` and its logs to
``OUT/nodeR/logs``; the head's metrics to ``OUT/node0/metrics.jsonl``. Every node's launcher is given
``CKPT_SAVE_DIR=OUT/checkpoints`` (storage every node mounts at the same path, as a cluster's nodes must
share it): with ``trainer.save_freq`` set the run saves there, and the same command run again resumes from
the last whole checkpoint there (verl's ``trainer.resume_mode=auto``).

``--fault kill-ray`` kills the last node's Ray (its whole process group, SIGKILL) ``--fault-delay``
seconds into step ``--fault-step``; ``--fault partition`` detaches that node's link from the switch
instead (the node runs on, its link keeps its carrier, nothing arrives: silent). ``OUT/rehearsal.json`` records every launcher's exit status and
time, the fault's time, the step then running (``fault_during_step``) and the step the checkpoint tracker
named then (``tracker_at_fault``, None without one), the Ray node ids and where verl's
workers ran (a run without a fault only: the query takes seconds on a loaded machine, and a fault must come
within its step), and every process still running in a namespace once its launcher had exited (none is expected).

Everything it makes is removed on exit, also on a failure or a signal: the processes still in its
namespaces (only these: a namespace is this run's own), then the namespaces (the veth pairs and the
bridge inside them go with them) and the Ray temp directory it made.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verl_patches.base.schema import Integer, Number, PathArg, Text
from verl_patches.train.checkpoint_commit import TRACKER

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "scripts" / "train_tiny.sh"
RAY_PORT = 6379  # inside the head's own namespace: nothing else listens there
WORKERS = 4  # the tiny config's layout: train TP2 x PP2 x EP2, rollout DP2 x TP2


class RehearsalError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RehearsalError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")
    return r


def netns_pids(name: str) -> list[int]:
    r = _ip("netns", "pids", name, check=False)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


class Network:
    """The namespaces of one rehearsal: ``TAGsw`` (the bridge) and ``TAGn0`` ... (the nodes)."""

    def __init__(self, tag: str, nodes: int, subnet: str = "10.213.0"):
        if not re.fullmatch(r"[a-z0-9]{1,10}", tag):
            raise RehearsalError(f"namespace tag {tag!r}: 1 to 10 lower-case letters or digits")
        self.tag, self.subnet = tag, subnet
        self.switch = f"{tag}sw"
        self.nodes = [f"{tag}n{i}" for i in range(nodes)]
        self.made: list[str] = []

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def port(self, rank: int) -> str:
        """The switch's end of a node's link (in the switch's namespace)."""
        return f"p{rank}"

    def create(self) -> None:
        if os.geteuid() != 0:
            raise RehearsalError("the rehearsal makes network namespaces: run it as root (ip netns needs it)")
        if shutil.which("ip") is None:
            raise RehearsalError("the rehearsal needs iproute2's `ip` (apt-get install iproute2)")
        taken = set(_ip("netns", "list").stdout.split())
        clash = [n for n in [self.switch, *self.nodes] if n in taken]
        if clash:
            raise RehearsalError(f"network namespace(s) {clash} exist already: another rehearsal's? (ip netns del NAME "
                                 "once it is over)")
        for name in [self.switch, *self.nodes]:
            _ip("netns", "add", name)
            self.made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for rank, node in enumerate(self.nodes):
            _ip("-n", self.switch, "link", "add", self.port(rank), "type", "veth", "peer", "name", "eth0", "netns", node)
            _ip("-n", self.switch, "link", "set", self.port(rank), "master", "br0", "up")
            _ip("-n", node, "addr", "add", f"{self.address(rank)}/24", "dev", "eth0")
            _ip("-n", node, "link", "set", "eth0", "up")

    def partition(self, rank: int) -> None:
        """Detach the node's port from the bridge: both ends keep their carrier and addresses, and
        nothing reaches the node or leaves it (a silent peer, not a dead one)."""
        _ip("-n", self.switch, "link", "set", self.port(rank), "nomaster")

    def leftovers(self) -> dict[str, list[str]]:
        """Processes still running in the nodes' namespaces: name -> their command lines."""
        out = {}
        for name in self.nodes:
            cmds = []
            for pid in netns_pids(name):
                try:
                    cmds.append(f"{pid} " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160])
                except OSError:
                    continue
            if cmds:
                out[name] = cmds
        return out

    def destroy(self) -> list[str]:
        """Kill what still runs in our namespaces, delete them; returns what could not be removed."""
        failed = []
        for name in reversed(self.made):
            for _ in range(50):
                pids = netns_pids(name)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            if _ip("netns", "del", name, check=False).returncode and name in _ip("netns", "list").stdout.split():
                failed.append(name)
        self.made = [n for n in self.made if n in failed]
        return failed


def _ray_query(net: Network, python: str, head_pid: int) -> dict:
    """The Ray node table and where each live actor runs, read from the head's GCS on the head's host (the
    namespaces of its launcher: network, mount, host name)."""
    code = f"""
import json, ray
from ray._private import state
ray.init(address="{net.address(0)}:{RAY_PORT}", logging_level="ERROR", log_to_driver=False)
nodes = {{n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}}
actors = [[a["ActorClassName"], a["Address"]["NodeID"]] for a in state.actors().values()
          if str(a.get("State")) in ("ALIVE", "2")]
ray.shutdown()
print(json.dumps({{"nodes": nodes, "actors": actors}}))
"""
    r = subprocess.run(["nsenter", f"--target={head_pid}", "--net", "--mount", "--uts", python, "-c", code],
                       capture_output=True, text=True, timeout=120, cwd="/")
    if r.returncode:
        return {"error": r.stderr[-2000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _started(log: Path, step: int) -> bool:
    """Whether the head's trainer has started training step ``step`` (the report's line of the one before)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return False
    if step == 1:
        return "Training Progress:" in text
    return re.search(rf"(?:^|\s)step {step - 1}/\d+ \|", text) is not None


def _running_step(log: Path) -> int:
    """The step the head's trainer is in: one past the last step its report logged."""
    try:
        done = re.findall(r"(?:^|\s)step (\d+)/\d+ \|", log.read_text(errors="replace"))
    except OSError:
        return 0
    return int(done[-1]) + 1 if done else 1


def _kill_ray(net: Network, rank: int) -> str:
    """SIGKILL the process group of the node's `ray start --block` (its raylet, its workers with it)."""
    for pid in netns_pids(net.nodes[rank]):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"start" in cmd and b"--block" in cmd and any(c.startswith(b"--address=") for c in cmd):
            pgid = os.getpgid(pid)
            os.killpg(pgid, signal.SIGKILL)
            return f"killed the process group {pgid} of `ray start` (pid {pid}) on {net.address(rank)}"
    raise RehearsalError(f"no `ray start` process found in {net.nodes[rank]}")


def run(out: Path, nodes: int, overrides: list[str], fault: str | None, fault_step: int, fault_delay: float,
        timeout: float, python: str, tag: str, health: dict[str, str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    if WORKERS % nodes:
        raise RehearsalError(f"--nodes {nodes}: the tiny config's {WORKERS} workers must spread evenly over the nodes")
    assets = out / "assets"
    r = subprocess.run([python, "-m", "verl_patches.rigs.tiny.assets", str(assets)], cwd=REPO, capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=_pythonpath()))
    if r.returncode:
        raise RehearsalError(f"building the tiny assets failed: {r.stderr[-2000:]}")
    net = Network(tag, nodes)
    # Short (Ray's socket paths are limited to 107 characters): the system's temp directory, not OUT.
    ray_tmp = Path(tempfile.mkdtemp(prefix=f"r{tag}"))
    procs: list[subprocess.Popen] = []
    record: dict = {"nodes": nodes, "fault": fault, "addresses": [net.address(i) for i in range(nodes)]}
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    for s in previous:
        signal.signal(s, stop)
    try:
        net.create()
        for rank in range(nodes):
            node_out = out / f"node{rank}"
            node_out.mkdir(exist_ok=True)
            env = dict(os.environ, SETUP_TEST_ENV="0", TINY_OUT=str(node_out), TINY_ASSETS=str(assets),
                       MASTER_ADDR=net.address(0), NODE_RANK=str(rank), NNODES=str(nodes),
                       DEVICES_PER_NODE=str(WORKERS // nodes), RAY_PORT=str(RAY_PORT), RAY_TEMP_DIR=str(ray_tmp),
                       VENV=str(Path(python).parent.parent), CKPT_SAVE_DIR=str(out / "checkpoints"), **health)
            for k in ("SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME", "ROLE",
                      "NODE_IP", "VLLM_HOST_IP"):
                env.pop(k, None)
            console = open(node_out / "console.log", "w")
            # A host of its own: its network namespace, its host name, and its own directory at the path
            # RAY_TEMP_DIR (Ray's worker nodes use the head's temp path, and two Ray nodes sharing one
            # directory take each other for the same host).
            node_tmp = node_out / "ray_tmp"
            node_tmp.mkdir(exist_ok=True)
            host = ["unshare", "--mount", "--uts", "--propagation", "private", "bash", "-c",
                    'hostname "$1" && mount --bind "$2" "$3" && shift 3 && exec "$@"', "_", f"node{rank}",
                    str(node_tmp), str(ray_tmp)]
            procs.append(subprocess.Popen(["ip", "netns", "exec", net.nodes[rank], *host, "bash", str(TINY), *overrides],
                                          env=env, cwd=REPO, stdout=console, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
            console.close()
        t0 = time.monotonic()
        record["exit"], record["exit_s"] = [None] * nodes, [None] * nodes
        head_log = out / "node0" / "logs" / "trainer.log"
        queried = injected = False
        while any(p.poll() is None for p in procs):
            now = time.monotonic() - t0
            if now > timeout:
                raise RehearsalError(f"the launchers ran past {timeout:.0f} s; see {out}/node*/console.log")
            for i, p in enumerate(procs):
                if p.poll() is not None and record["exit"][i] is None:
                    record["exit"][i], record["exit_s"][i] = p.returncode, round(now, 1)
            if not fault and not queried and _started(head_log, 1) and procs[0].poll() is None:
                record["ray"] = _ray_query(net, python, procs[0].pid)
                queried = True
            if fault and not injected and _started(head_log, fault_step):
                time.sleep(fault_delay)
                victim = nodes - 1
                if fault == "kill-ray":
                    record["fault_action"] = _kill_ray(net, victim)
                else:
                    net.partition(victim)
                    record["fault_action"] = f"the link of {net.address(victim)} detached from the switch"
                record["fault_s"] = round(time.monotonic() - t0, 1)
                record["fault_during_step"] = _running_step(head_log)
                tracker = out / "checkpoints" / TRACKER
                record["tracker_at_fault"] = int(tracker.read_text()) if tracker.is_file() else None
                injected = True
            time.sleep(0.5)
        now = time.monotonic() - t0
        for i, p in enumerate(procs):
            if record["exit"][i] is None:
                record["exit"][i], record["exit_s"][i] = p.returncode, round(now, 1)
        if fault and not injected:
            record["fault_action"] = None
        # Whatever a launcher left in its namespace (its own processes, its Ray's): none expected.
        record["leftovers"] = net.leftovers()
        return record
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        failed = net.destroy()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        for s, h in previous.items():
            signal.signal(s, h)
        if failed:
            print(f"error: could not delete network namespace(s) {failed}: ip netns del NAME", file=sys.stderr)
        (out / "rehearsal.json").write_text(json.dumps(record, indent=1))


def _pythonpath() -> str:
    return os.pathsep.join([str(REPO), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=PathArg("output directory"),
                   help="the rehearsal's directory (node0/, node1/, ..., rehearsal.json)")
    p.add_argument("--nodes", type=Integer(low=2, high=4), default=2,
                   help="nodes (namespaces); the tiny config's 4 workers spread over them")
    p.add_argument("--fault", choices=("kill-ray", "partition"), default=None, help="lose the last node mid-step")
    p.add_argument("--fault-step", type=Integer(low=1), default=1, help="the step during which the node is lost")
    p.add_argument("--fault-delay", type=Number(low=0, high=3600), default=2.0, help="seconds into that step")
    p.add_argument("--timeout", type=Number(low=0, low_open=True, high=86400), default=1200.0,
                   help="seconds the launchers may run in all")
    p.add_argument("--tag", type=Text(max_len=10), default=f"vr{os.getpid() % 100000}",
                   help="prefix of the namespaces' names (1 to 10 lower-case letters or digits)")
    p.add_argument("--health", type=Text(empty=True), default="", help="Ray health-check settings for every node, NAME=VALUE,... "
                   "(e.g. RAY_health_check_period_ms=1000)")
    args, overrides = p.parse_known_args(argv)
    if args.nodes < 2:
        p.error("--nodes: at least 2 (one node is scripts/train_tiny.sh)")
    health = dict(kv.split("=", 1) for kv in args.health.split(",") if kv)
    try:
        rec = run(args.out.resolve(), args.nodes, overrides, args.fault, args.fault_step, args.fault_delay,
                  args.timeout, sys.executable, args.tag, health)
    except RehearsalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rec, indent=1))
    ok = (rec["exit"][0] == 0 if not args.fault else rec["exit"][0] not in (0, None)) and not rec["leftovers"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
