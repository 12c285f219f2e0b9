"""``python -m verl_patches rollout-plan``: a small discrete-event model of the rollout's lockstep DP
decode, to see its long tail and choose ``graph_batch_sizes``, ``max_num_seqs`` and the rebalance
threshold before spending cluster hours (docs/ROLLOUT.md).

The model. ``sequences`` responses are split over ``dp`` ranks in contiguous chunks (as verl splits a
batch); each rank runs at most ``max_num_seqs`` at once and admits its waiting ones as others finish.
All ranks step together: one decode step of the group costs ``tpot(graph_size, context)`` where graph size is
the captured graph batch size of the fullest rank (every rank pads to it: MoE all-to-all) and context
is the longest running sequence's tokens (prompt + generated; TorchAir's fixed shapes pay for it), plus
a per-step synchronisation overhead. A response of length L admitted at step a ends at step a + L
whatever rank it runs on, so the model jumps from one end-of-sequence event to the next; the group
stops when its last response ends (the EOS agreement of the DP group). Admitting a sequence costs its
prompt's prefill, moving one costs the prefill of its prompt and generated tokens on its new rank
(re-computing its KV: an upper bound for a mechanism that moves the KV), each as the slowest rank's
share. At every event the rebalance policy of verl_patches/rollout/long_tail/rebalance.py (imported: the same
code) is asked whether to move requests, and its plan is applied.

Inputs: a response-length distribution (parametric, a recorded sample, or a run's metrics.jsonl whose
per-step response-length statistics are fitted) and a TPOT table per graph size (a YAML/JSON file, a
preset, or ``B=MS,...`` on the command line). Output: the predicted rollout time, the tail's share,
the time per graph size, a recommendation, and a PNG of running requests and TPOT over time.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any, Sequence

import numpy as np

from verl_patches.rollout.long_tail import rebalance as rb
from verl_patches.base.schema import Integer, Number, Text, refuse_renamed

MAX_SEQUENCES = 1_000_000
MAX_LEN = 1_048_576
MAX_DP = 65_536
MAX_GRAPH_SIZE = 65_536


class PlanError(ValueError):
    """Bad input to the rollout planner; the message names the input."""


# ---------- the TPOT table ----------

@dataclass(frozen=True)
class TpotTable:
    """Milliseconds of one decode step of the DP group, per captured graph size, as points (context tokens,
    ms) interpolated linearly (held flat outside the measured range)."""

    points: dict[int, tuple[tuple[int, float], ...]]
    prefill_ms_per_token: float = 0.05
    step_overhead_ms: float = 0.0
    source: str = ""

    def check(self, graph_sizes: Sequence[int]) -> None:
        missing = [b for b in graph_sizes if b not in self.points]
        if missing:
            raise PlanError(f"the TPOT table ({self.source}) has no entry for graph batch size(s) {missing} "
                            f"(it has {sorted(self.points)})")

    def ms(self, graph_size: int, ctx: float) -> float:
        xs, ys = zip(*self.points[graph_size])
        return float(np.interp(ctx, xs, ys))

    def sum_ms(self, graph_size: int, ctx0: int, n: int) -> float:
        """Sum of the TPOT of ``n`` steps at contexts ctx0, ctx0+1, ... plus the steps' overhead."""
        pts = self.points[graph_size]
        if len(pts) == 1:
            return n * (pts[0][1] + self.step_overhead_ms)
        xs, ys = zip(*pts)
        return float(np.interp(np.arange(ctx0, ctx0 + n, dtype=np.float64), xs, ys).sum()) + n * self.step_overhead_ms


def _num(value: Any, what: str, low: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < low or (strict and value == low):
        raise PlanError(f"{what} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")
    return float(value)


def _int(value: Any, what: str, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise PlanError(f"{what} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        rng = f">= {low}" + (f" and <= {high}" if high is not None else "")
        raise PlanError(f"{what} must be an integer {rng}, got {value!r}")
    return value


def table_from_mapping(data: Any, source: str) -> TpotTable:
    """{"tpot_ms": {graph size: ms | {context: ms, ...}}, "prefill_ms_per_token": x, "step_overhead_ms": y}."""
    if not isinstance(data, dict) or "tpot_ms" not in data:
        raise PlanError(f"{source}: a TPOT table is a mapping with a 'tpot_ms' mapping (graph size -> ms, or "
                        f"graph size -> {{context tokens: ms}})")
    unknown = set(data) - {"tpot_ms", "prefill_ms_per_token", "step_overhead_ms", "note"}
    if unknown:
        raise PlanError(f"{source}: unknown key(s) {sorted(map(str, unknown))} (known: tpot_ms, "
                        f"prefill_ms_per_token, step_overhead_ms, note)")
    raw = data["tpot_ms"]
    if not isinstance(raw, dict) or not raw:
        raise PlanError(f"{source}: tpot_ms must be a non-empty mapping graph size -> ms, got {raw!r}")
    points: dict[int, tuple[tuple[int, float], ...]] = {}
    for b, v in raw.items():
        graph_size = _int(b, f"{source}: tpot_ms graph size {b!r}", 1, MAX_GRAPH_SIZE)
        if graph_size in points:
            raise PlanError(f"{source}: tpot_ms lists graph size {graph_size} twice")
        if isinstance(v, dict):
            if not v:
                raise PlanError(f"{source}: tpot_ms[{graph_size}] has no points")
            pts = sorted((_int(c, f"{source}: tpot_ms[{graph_size}] context {c!r}", 0, MAX_LEN * 2),
                          _num(ms, f"{source}: tpot_ms[{graph_size}][{c}]", 0.0, strict=True)) for c, ms in v.items())
            if len({c for c, _ in pts}) != len(pts):
                raise PlanError(f"{source}: tpot_ms[{graph_size}] lists a context twice")
        else:
            pts = [(0, _num(v, f"{source}: tpot_ms[{graph_size}]", 0.0, strict=True))]
        points[graph_size] = tuple(pts)
    return TpotTable(points, _num(data.get("prefill_ms_per_token", 0.05), f"{source}: prefill_ms_per_token"),
                     _num(data.get("step_overhead_ms", 0.0), f"{source}: step_overhead_ms"), source)


def reference_a3_table() -> TpotTable:
    """The assumed TPOT of the reference's DeepSeek-V3 TP2 DP128 rollout on A3 (docs/ROLLOUT.md): a
    50 ms floor (weights, MoE all-to-all, synchronisation) plus a batch share that grows with the
    padded context, 75 ms x (b / 64) x (1 + context / 32768). The one captured graph size (64) then climbs
    from 125 ms to 200 ms as the longest response grows to 32K, the reference's default figures, and
    the small graph sizes of the tail take 51 to 69 ms, its "near 60 ms" with rebalance. Assumed, not
    measured: the reference publishes only those figures."""
    pts = {b: ((0, 50 + 75 * b / 64), (32768, 50 + 75 * b / 64 * 2)) for b in (1, 2, 4, 8, 16, 32, 64)}
    return TpotTable(pts, prefill_ms_per_token=0.05, step_overhead_ms=0.0, source="preset reference-a3")


PRESETS = {"reference-a3": reference_a3_table}


def load_table(spec: str) -> TpotTable:
    """A preset name, a YAML/JSON file, or ``B=MS[,B=MS...]`` (constant per graph size)."""
    if spec in PRESETS:
        return PRESETS[spec]()
    path = Path(spec)
    try:
        is_file = path.suffix.lower() in (".yaml", ".yml", ".json") or path.is_file()
    except (OSError, ValueError):  # a name no file system takes (a NUL byte, too long)
        is_file = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise PlanError(f"--tpot {spec}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        try:
            # Lazy: PyYAML for a TPOT file and matplotlib (slow, optional) for the figure only.
            import yaml

            data = yaml.safe_load(text)
        except Exception as e:  # noqa: BLE001 - yaml's errors have no common public base besides YAMLError
            raise PlanError(f"--tpot {spec}: not YAML/JSON ({type(e).__name__})") from None
        return table_from_mapping(data, f"--tpot {spec}")
    pairs = {}
    for item in spec.split(","):
        b, sep, ms = item.partition("=")
        if not sep:
            raise PlanError(f"--tpot {spec!r}: expected a preset ({', '.join(PRESETS)}), a YAML/JSON file, or "
                            f"BUCKET=MS[,BUCKET=MS...]")
        try:
            value = float(ms)
        except ValueError:
            raise PlanError(f"--tpot {spec!r}: {ms!r} is not a number of ms") from None
        pairs[b.strip()] = value
    return table_from_mapping({"tpot_ms": pairs}, "--tpot")


# ---------- response lengths ----------

@dataclass(frozen=True)
class LengthSource:
    """How the response lengths are drawn; ``sample(rng, n)`` gives n ints in [1, max_len]."""

    kind: str  # "spec", "sample" or "metrics"
    describe: str
    components: tuple = ()  # spec: (weight, kind, params)
    values: tuple[int, ...] = ()  # sample
    fit: dict = field(default_factory=dict)  # metrics: the record's statistics and the fitted lognormal
    prompt_len: float | None = None  # metrics: prompt_length/mean

    def sample(self, rng: np.random.Generator, n: int, max_len: int) -> np.ndarray:
        if self.kind == "sample":
            if max(self.values) > max_len:
                raise PlanError(f"{self.describe}: a recorded length {max(self.values)} exceeds --max-len {max_len}")
            return rng.choice(np.asarray(self.values, dtype=np.int64), size=n, replace=True)
        if self.kind == "metrics":
            return _fitted_sample(self.fit, rng, n)
        weights = np.array([w for w, _, _ in self.components], dtype=np.float64)
        weights = weights / weights.max()  # no overflow in the sum
        which = rng.choice(len(self.components), size=n, p=weights / weights.sum())
        out = np.empty(n, dtype=np.float64)
        for k, (_, kind, p) in enumerate(self.components):
            m = int((which == k).sum())
            if kind == "lognormal":
                out[which == k] = rng.lognormal(math.log(p["median"]), p["sigma"], m)
            elif kind == "uniform":
                out[which == k] = rng.uniform(p["low"], p["high"], m)
            elif kind == "fixed":
                out[which == k] = p["value"]
            else:  # cap
                out[which == k] = max_len
        return np.clip(np.rint(out), 1, max_len).astype(np.int64)


_KINDS = {"lognormal": ("median", "sigma"), "uniform": ("low", "high"), "fixed": ("value",), "cap": ()}


def parse_lengths_spec(spec: str) -> LengthSource:
    """``[W*]KIND[:K=V,...][;...]``: e.g. ``lognormal:median=3000,sigma=0.9`` or
    ``0.95*lognormal:median=2000,sigma=0.8;0.05*cap`` (cap: the maximum response length)."""
    comps = []
    for part in spec.split(";"):
        part = part.strip()
        weight, star, rest = part.partition("*")
        if not star:
            weight, rest = "1", part
        try:
            w = float(weight)
        except ValueError:
            raise PlanError(f"--lengths {spec!r}: weight {weight!r} is not a number") from None
        if not (math.isfinite(w) and w > 0):
            raise PlanError(f"--lengths {spec!r}: weight {weight!r} must be a positive number")
        kind, _, params = rest.strip().partition(":")
        if kind not in _KINDS:
            raise PlanError(f"--lengths {spec!r}: unknown distribution {kind!r} (known: {', '.join(_KINDS)}; "
                            f"or a file: .json list, .jsonl, .txt)")
        p: dict[str, float] = {}
        for kv in filter(None, (x.strip() for x in params.split(","))):
            k, eq, v = kv.partition("=")
            if not eq or k not in _KINDS[kind]:
                raise PlanError(f"--lengths {spec!r}: {kind} takes {', '.join(_KINDS[kind]) or 'no parameter'}, got {kv!r}")
            try:
                p[k] = float(v)
            except ValueError:
                raise PlanError(f"--lengths {spec!r}: {k}={v!r} is not a number") from None
            if not math.isfinite(p[k]) or p[k] < 0 or (k in ("median", "value", "high") and p[k] < 1) or p[k] > MAX_LEN:
                raise PlanError(f"--lengths {spec!r}: {k}={v} is out of range")
        if set(p) != set(_KINDS[kind]):
            raise PlanError(f"--lengths {spec!r}: {kind} needs {', '.join(_KINDS[kind])}")
        if kind == "uniform" and p["low"] > p["high"]:
            raise PlanError(f"--lengths {spec!r}: uniform low > high")
        if kind == "lognormal" and p["sigma"] > 5:
            raise PlanError(f"--lengths {spec!r}: sigma={p['sigma']} is out of range (0 to 5)")
        comps.append((w, kind, p))
    return LengthSource("spec", spec, components=tuple(comps))


RESPONSE_STATS = ("response_length/mean", "response_length/min", "response_length/max", "response_length/clip_ratio")


def read_lengths_file(path: Path, step: int | None = None) -> LengthSource:
    """A recorded sample (a JSON list of ints; text with one int per line; JSONL with "response_length"
    per line) or a run's metrics.jsonl (verl_patches/reporting/report.py; verl's response_length/* per step),
    whose step ``step`` (default: the last with those statistics) is fitted."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PlanError(f"--lengths {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise PlanError(f"--lengths {path}: the file is empty")
    values: list[int] = []
    records: list[dict] = []
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"--lengths {path}: not JSON ({e.msg}, line {e.lineno})") from None
        if not isinstance(data, list) or not data:
            raise PlanError(f"--lengths {path}: a .json sample is a non-empty list of response lengths")
        values = [_int(v, f"--lengths {path}: length {v!r}", 1, MAX_LEN) for v in data]
    elif lines[0].startswith("{"):
        for n, line in enumerate(lines, 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PlanError(f"--lengths {path}: line {n} is not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise PlanError(f"--lengths {path}: line {n} is not a JSON object")
            if "response_length" in rec:
                values.append(_int(rec["response_length"], f"--lengths {path}: line {n} response_length", 1, MAX_LEN))
            else:
                records.append(rec)
        if values and records:
            raise PlanError(f"--lengths {path}: mixes per-response lines and other records")
    else:
        for n, line in enumerate(lines, 1):
            values.append(_int(line, f"--lengths {path}: line {n}", 1, MAX_LEN))
    if values:
        return LengthSource("sample", f"{len(values)} recorded lengths from {path}", values=tuple(values))
    stats = [r for r in records if all(k in r for k in RESPONSE_STATS)]
    if not stats:
        raise PlanError(f"--lengths {path}: no line has response lengths ('response_length', or a metrics "
                        f"record with {', '.join(RESPONSE_STATS)})")
    if step is None:
        rec = stats[-1]
    else:
        chosen = [r for r in stats if r.get("step") == step]
        if not chosen:
            raise PlanError(f"--metrics-step {step}: {path} has response lengths for steps "
                            f"{[r.get('step') for r in stats]}")
        rec = chosen[-1]
    fit = fit_metrics(rec, f"{path} step {rec.get('step')}")
    prompt = rec.get("prompt_length/mean")
    prompt = prompt if isinstance(prompt, (int, float)) and not isinstance(prompt, bool) \
        and math.isfinite(prompt) and 0 <= prompt <= MAX_LEN else None
    return LengthSource("metrics", f"{path} step {rec.get('step')} (fitted)", fit=fit, prompt_len=prompt)


def fit_metrics(rec: dict, where: str) -> dict:
    """A capped lognormal from verl's per-step statistics: the clip ratio's share at the cap (the max,
    when any response was cut), the rest lognormal with the unclipped mean, its sigma from the min read
    as the expected smallest of the unclipped count: ln(mean) - ln(min) = sigma^2/2 + z sigma."""
    vals = {}
    for k in RESPONSE_STATS:
        v = rec[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise PlanError(f"{where}: {k} is not a finite number ({v!r})")
        vals[k.split("/")[1]] = float(v)
    mean, lo, hi, clip = vals["mean"], vals["min"], vals["max"], vals["clip_ratio"]
    if not (0 <= clip <= 1) or not (1 <= lo <= mean <= hi <= MAX_LEN):
        raise PlanError(f"{where}: inconsistent response lengths (need 1 <= min <= mean <= max and a clip ratio "
                        f"in [0, 1]; got min {lo}, mean {mean}, max {hi}, clip_ratio {clip})")
    fit = {"mean": mean, "min": lo, "max": hi, "clip_ratio": clip, "cap": int(round(hi))}
    if clip >= 1 or hi == lo:  # every response at the cap, or all of one length
        fit.update(degenerate=True, unclipped_mean=mean)
        return fit
    m_u = (mean - clip * hi) / (1 - clip)
    if not (lo <= m_u < hi or (clip == 0 and m_u <= hi)):
        raise PlanError(f"{where}: a clip ratio of {clip} at max {hi} leaves an unclipped mean of {m_u:.1f}, "
                        f"outside [min {lo}, max {hi})")
    fit.update(degenerate=False, unclipped_mean=m_u)
    return fit


def _fitted_sample(fit: dict, rng: np.random.Generator, n: int) -> np.ndarray:
    cap, clip = fit["cap"], fit["clip_ratio"]
    n_cap = int(round(clip * n))
    if fit["degenerate"]:
        return np.full(n, int(round(fit["mean"])) if clip < 1 else cap, dtype=np.int64)
    n_u = n - n_cap
    m_u, lo = fit["unclipped_mean"], fit["min"]
    z = NormalDist().inv_cdf(1 - 1 / (n_u + 1)) if n_u > 0 else 0.0
    d = math.log(m_u) - math.log(lo)
    sigma = -z + math.sqrt(z * z + 2 * d) if d > 0 else 0.0
    mu = math.log(m_u) - sigma * sigma / 2
    upper = cap - 1 if clip > 0 else cap
    body = np.clip(np.rint(rng.lognormal(mu, sigma, n_u)), max(1, int(lo)), max(1, upper))
    return np.concatenate([body.astype(np.int64), np.full(n_cap, cap, dtype=np.int64)])


# ---------- the model ----------

@dataclass(frozen=True)
class Scenario:
    dp: int
    max_num_seqs: int
    graph_sizes: tuple[int, ...]
    policy: rb.RebalancePolicy
    prompt_len: int
    table: TpotTable

    def label(self) -> str:
        reb = (f"rebalance (drop >= {self.policy.min_graph_size_drop}"
               + (f" or imbalance > {self.policy.max_imbalance}" if self.policy.max_imbalance else "") + ")"
               if self.policy.enabled else "no rebalance")
        return f"graph_batch_sizes {list(self.graph_sizes)}, {reb}"


@dataclass
class Result:
    scenario: Scenario
    total_s: float
    decode_s: float
    prefill_s: float
    migrate_s: float
    steps: int
    moves: int
    rebalances: int
    tail_s: float  # after the tail fraction of responses ended
    tail_fraction: float
    graph_size_s: dict[int, float]  # seconds per group graph size
    graph_size_fill: dict[int, float]  # time-weighted real share of the padded slots
    # (t0, t1, running, graph size, mean tpot ms) per segment between events
    segments: list[tuple[float, float, int, int, float]]

    @property
    def tail_share(self) -> float:
        return self.tail_s / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"config": self.scenario.label(), "graph_batch_sizes": list(self.scenario.graph_sizes),
                "rebalance": self.scenario.policy.enabled,
                "rebalance_min_graph_size_drop": self.scenario.policy.min_graph_size_drop,
                "rebalance_max_imbalance": self.scenario.policy.max_imbalance,
                "total_s": self.total_s, "decode_s": self.decode_s, "prefill_s": self.prefill_s,
                "migrate_s": self.migrate_s, "steps": self.steps, "moves": self.moves,
                "rebalances": self.rebalances, "tail_s": self.tail_s, "tail_share": self.tail_share,
                "tail_fraction": self.tail_fraction,
                "graph_size_s": {str(b): s for b, s in self.graph_size_s.items()},
                "graph_size_fill": {str(b): f for b, f in self.graph_size_fill.items()}}


def simulate(sc: Scenario, lengths: np.ndarray, tail_fraction: float = 0.9) -> Result:
    """Run the model once over ``lengths`` (one response each)."""
    graph_sizes = rb.check_graph_sizes(list(sc.graph_sizes))
    sc.table.check(graph_sizes)
    if sc.max_num_seqs > graph_sizes[-1]:
        raise PlanError(f"max_num_seqs {sc.max_num_seqs} exceeds the largest graph batch size {graph_sizes[-1]}")
    D, S, P = sc.dp, len(lengths), sc.prompt_len
    lengths = [int(x) for x in lengths]
    pf = sc.table.prefill_ms_per_token / 1000.0
    bounds = np.linspace(0, S, D + 1).round().astype(int)
    queues = [deque(range(bounds[r], bounds[r + 1])) for r in range(D)]
    running: list[set[int]] = [set() for _ in range(D)]
    rank_of = [0] * S
    admitted = [0] * S
    ends: list[tuple[int, int]] = []  # (end step, sequence)
    starts: list[tuple[int, int]] = []  # (admit step, sequence), lazily pruned
    done = [False] * S

    def admit(ranks: Sequence[int], step: int) -> float:
        worst = 0
        for r in ranks:
            n = 0
            while queues[r] and len(running[r]) < sc.max_num_seqs:
                i = queues[r].popleft()
                running[r].add(i)
                rank_of[i], admitted[i] = r, step
                heapq.heappush(ends, (step + lengths[i], i))
                heapq.heappush(starts, (step, i))
                n += 1
            worst = max(worst, n * P)
        return worst * pf

    prefill = admit(range(D), 0)
    t = prefill
    decode = migrate = 0.0
    step = moves = rebalances = finished = 0
    need = math.ceil(tail_fraction * S)
    tail_at = t if need == 0 else None
    graph_size_s: dict[int, float] = {}
    fill: dict[int, float] = {}
    segments: list[tuple[float, float, int, int, float]] = []
    while ends:
        nxt = ends[0][0]
        while starts and done[starts[0][1]]:
            heapq.heappop(starts)
        counts = [len(x) for x in running]
        total = sum(counts)
        graph_size = rb.graph_size_for(max(counts), graph_sizes)
        n = nxt - step
        if n > 0:
            ctx0 = P + step - starts[0][0]
            dt = sc.table.sum_ms(graph_size, ctx0, n) / 1000.0
            segments.append((t, t + dt, total, graph_size, dt * 1000.0 / n))
            graph_size_s[graph_size] = graph_size_s.get(graph_size, 0.0) + dt
            fill[graph_size] = fill.get(graph_size, 0.0) + dt * total / (D * graph_size)
            t += dt
            decode += dt
        step = nxt
        touched = set()
        while ends and ends[0][0] == step:
            _, i = heapq.heappop(ends)
            done[i] = True
            running[rank_of[i]].discard(i)
            touched.add(rank_of[i])
            finished += 1
        if tail_at is None and finished >= need:
            tail_at = t
        cost = admit(sorted(touched), step)
        prefill += cost
        t += cost
        if sc.policy.enabled and ends:
            counts_map = {r: len(running[r]) for r in range(D)}
            verdict = rb.judge(counts_map, graph_sizes, sc.policy, capacity=sc.max_num_seqs)
            if verdict.rebalance:
                layout = {r: sorted(running[r]) for r in range(D)}
                weights = {i: P + step - admitted[i] for ids in layout.values() for i in ids}
                decision = rb.decide(layout, graph_sizes, sc.policy, capacity=sc.max_num_seqs, weights=weights)
                per_dst: dict[int, int] = {}
                for m in decision.moves:
                    running[m.src].discard(m.request)
                    running[m.dst].add(m.request)
                    rank_of[m.request] = m.dst
                    per_dst[m.dst] = per_dst.get(m.dst, 0) + weights[m.request]
                cost = max(per_dst.values(), default=0) * pf
                migrate += cost
                t += cost
                moves += len(decision.moves)
                rebalances += 1
    tail_s = t - (tail_at if tail_at is not None else t)
    return Result(sc, t, decode, prefill, migrate, step, moves, rebalances, tail_s, tail_fraction,
                  dict(sorted(graph_size_s.items())),
                  {b: fill[b] / graph_size_s[b] for b in sorted(graph_size_s) if graph_size_s[b] > 0}, segments)


# ---------- the recommendation ----------

@dataclass
class Recommendation:
    max_num_seqs: int
    baseline: Result  # one graph size (max_num_seqs), no rebalance: the configs today
    graph_sizes_only: Result  # the recommended graph sizes without rebalance
    best: Result  # the recommended graph sizes and threshold
    tried: int
    note: str


def recommend(base: Scenario, lengths: np.ndarray, min_gain: float = 0.02, tail_fraction: float = 0.9) -> Recommendation:
    """Greedy: from the one graph size max_num_seqs, add the table's graph size that shortens the rollout most
    (rebalance on, drop >= 1) while it gains at least ``min_gain`` of the time (each graph costs
    capture time and memory); then the threshold (drop 1, 2, 3) that is fastest (ties: the larger drop,
    which moves fewer requests)."""
    mns = base.max_num_seqs
    fits = [b for b in sorted(base.table.points) if b >= mns]
    if not fits:
        raise PlanError(f"the TPOT table ({base.table.source}) has no graph size >= max_num_seqs {mns} to recommend from")
    top = fits[0]
    off = rb.RebalancePolicy(enabled=False)
    on = rb.RebalancePolicy(enabled=True, min_graph_size_drop=1)
    tried = 0

    def run(graph_sizes: tuple[int, ...], policy: rb.RebalancePolicy) -> Result:
        nonlocal tried
        tried += 1
        return simulate(replace(base, graph_sizes=graph_sizes, policy=policy), lengths, tail_fraction)

    baseline = run((top,), off)
    chosen = (top,)
    current = baseline
    candidates = sorted(b for b in base.table.points if b < top)
    while candidates:
        trials = [(run(tuple(sorted(chosen + (b,))), on), b) for b in candidates]
        res, b = min(trials, key=lambda x: (x[0].total_s, -x[1]))
        if res.total_s > current.total_s * (1 - min_gain):
            break
        chosen, current = tuple(sorted(chosen + (b,))), res
        candidates.remove(b)
    best = current
    if len(chosen) > 1:
        for drop in range(2, min(3, len(chosen) - 1) + 1):
            res = run(chosen, rb.RebalancePolicy(enabled=True, min_graph_size_drop=drop))
            if res.total_s <= best.total_s * (1 + 1e-9):
                best = res
    graph_sizes_only = run(chosen, off) if len(chosen) > 1 else baseline
    note = "" if len(chosen) > 1 else "no smaller graph size gains enough: keep one graph and no rebalance"
    return Recommendation(mns, baseline, graph_sizes_only, best, tried, note)


# ---------- the CLI ----------

def _png(path: Path, results: list[Result]) -> None:
    try:
        # Lazy: PyYAML for a TPOT file and matplotlib (slow, optional) for the figure only.
        import matplotlib
    except ImportError:
        raise PlanError("the PNG needs matplotlib (requirements.txt)") from None
    matplotlib.use("Agg")
    # Lazy: PyYAML for a TPOT file and matplotlib (slow, optional) for the figure only.
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for res in results:
        xs, run_, tp = [], [], []
        for t0, t1, running, _, ms in res.segments:
            xs += [t0, t1]
            run_ += [running, running]
            tp += [ms, ms]
        label = f"{res.scenario.label()}: {res.total_s:,.0f} s"
        ax1.plot(xs, run_, label=label)
        ax2.plot(xs, tp, label=label)
    ax1.set_ylabel("running requests (DP group)")
    ax1.set_yscale("symlog", linthresh=10)
    ax1.legend(fontsize=7)
    ax2.set_ylabel("TPOT of the group step (ms)")
    ax2.set_xlabel("seconds into the rollout")
    fig.suptitle("rollout-plan: lockstep DP decode", fontsize=10)
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise PlanError(f"--png {path}: cannot write it ({e.strerror or e})") from None
    finally:
        plt.close(fig)


def _report(res: Result) -> list[str]:
    occ = ", ".join(f"{b}: {s:,.0f} s ({s / res.total_s:.0%}, {res.graph_size_fill[b]:.0%} full)"
                    for b, s in res.graph_size_s.items()) if res.total_s > 0 else "-"
    return [f"  {res.scenario.label()}",
            f"    rollout {res.total_s:,.1f} s (decode {res.decode_s:,.1f}, prefill {res.prefill_s:,.1f}, "
            f"moves {res.migrate_s:,.1f}); {res.steps} decode steps",
            f"    tail (after {res.tail_fraction:.0%} of the responses ended): {res.tail_s:,.1f} s "
            f"= {res.tail_share:.0%} of the rollout",
            f"    time per group graph size: {occ}",
            f"    {res.moves} request(s) moved in {res.rebalances} rebalance(s)"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verl_patches rollout-plan",
                                description=__doc__.split("\n\n")[0].replace("``", "`"))
    p.add_argument("--dp", type=Integer(low=1, high=MAX_DP), default="128", help="DP ranks of one vLLM instance, stepping together (default 128)")
    p.add_argument("--prompts", type=Integer(low=1, high=MAX_SEQUENCES), default="512", help="prompts per rollout (default 512)")
    p.add_argument("--n", type=Integer(low=1, high=MAX_SEQUENCES), default="16", help="responses per prompt (default 16)")
    p.add_argument("--max-len", type=Integer(low=1, high=MAX_LEN), default=None, help="the maximum response length (default 32768; a metrics "
                                                   "record with clipped responses gives it)")
    p.add_argument("--prompt-len", type=Integer(low=0, high=MAX_LEN), default=None, help="prompt tokens (default: the record's mean, else 512)")
    p.add_argument("--lengths", type=Text(), default="lognormal:median=3000,sigma=0.9",
                   help="response lengths: [W*]KIND[:K=V,...][;...] with KIND lognormal (median, sigma), uniform "
                        "(low, high), fixed (value), cap; or a file: .json list, text (one per line), JSONL with "
                        "response_length per line, or a run's metrics.jsonl (fitted)")
    p.add_argument("--metrics-step", type=Integer(low=0), default=None, help="the metrics.jsonl step to fit (default: the last)")
    p.add_argument("--tpot", type=Text(), default="reference-a3",
                   help=f"TPOT per graph size: a preset ({', '.join(PRESETS)}), a YAML/JSON file, or B=MS[,B=MS...]")
    p.add_argument("--graph-batch-sizes", type=Text(), default=None, help="graph sizes to model, e.g. 8,16,32,64 (default: max_num_seqs)")
    p.add_argument("--max-num-seqs", type=Integer(low=1, high=MAX_GRAPH_SIZE), default=None, help="per-rank running sequences (default: responses / dp)")
    p.add_argument("--rebalance", action="store_true", help="model the rebalance policy with the settings below")
    p.add_argument("--min-graph-size-drop", type=Integer(low=1, high=64), default="1", help="recipe.rebalance_min_graph_size_drop (default 1)")
    refuse_renamed(p, {"--min-bucket-drop": "--min-graph-size-drop"})  # issue 38: graph sizes, not buckets
    p.add_argument("--max-imbalance", type=Number(low=1, high=1e9), default=None, help="recipe.rebalance_max_imbalance (default: null)")
    p.add_argument("--tail-fraction", type=Number(low=0, high=1), default="0.9", help="the tail starts when this share of responses ended")
    p.add_argument("--seed", type=Integer(low=0, high=2 ** 32 - 1), default="0", help="seed of the length sample")
    p.add_argument("--no-recommend", action="store_true", help="model the given configuration only")
    p.add_argument("--min-gain", type=Number(low=0, high=1), default="0.02", help="an extra graph size must save this share (default 0.02)")
    p.add_argument("--png", type=Text(), default="rollout_plan.png", help="the figure (default rollout_plan.png)")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _float(text: str, what: str, low: float, high: float) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise PlanError(f"{what} must be a number, got {text!r}") from None
    if not (math.isfinite(v) and low <= v <= high):
        raise PlanError(f"{what} must be between {low:g} and {high:g}, got {text!r}")
    return v


def plan(args: argparse.Namespace) -> dict:
    dp = _int(args.dp, "--dp", 1, MAX_DP)
    sequences = _int(args.prompts, "--prompts", 1, MAX_SEQUENCES) * _int(args.n, "--n", 1, MAX_SEQUENCES)
    if sequences > MAX_SEQUENCES:
        raise PlanError(f"--prompts x --n = {sequences} responses: at most {MAX_SEQUENCES}")
    seed = _int(args.seed, "--seed", 0, 2 ** 32 - 1)
    tail = _float(args.tail_fraction, "--tail-fraction", 0.0, 1.0)
    min_gain = _float(args.min_gain, "--min-gain", 0.0, 1.0)
    step = None if args.metrics_step is None else _int(args.metrics_step, "--metrics-step", 0)
    spec = args.lengths
    looks_like_file = Path(spec).suffix.lower() in (".json", ".jsonl", ".txt") or (
        ":" not in spec and "*" not in spec and spec not in _KINDS)
    src = read_lengths_file(Path(spec), step) if looks_like_file else parse_lengths_spec(spec)
    if step is not None and src.kind != "metrics":
        raise PlanError("--metrics-step needs --lengths to be a run's metrics.jsonl")
    if args.max_len is not None:
        max_len = _int(args.max_len, "--max-len", 1, MAX_LEN)
    elif src.kind == "metrics" and src.fit["clip_ratio"] > 0:
        max_len = src.fit["cap"]
    else:
        max_len = 32768
    if src.kind == "metrics":
        if src.fit["clip_ratio"] > 0 and src.fit["cap"] != max_len:
            raise PlanError(f"--max-len {max_len}: the record's responses were cut at {src.fit['cap']} tokens "
                            f"(clip_ratio {src.fit['clip_ratio']})")
        if src.fit["max"] > max_len:
            raise PlanError(f"--max-len {max_len} is below the record's longest response {src.fit['max']:g}")
    if args.prompt_len is not None:
        prompt_len = _int(args.prompt_len, "--prompt-len", 0, MAX_LEN)
    else:
        prompt_len = int(round(src.prompt_len)) if src.prompt_len is not None else 512
    table = load_table(args.tpot)
    per_rank = math.ceil(sequences / dp)
    if args.max_num_seqs is not None:
        mns = _int(args.max_num_seqs, "--max-num-seqs", 1, MAX_GRAPH_SIZE)
    else:
        fits = [b for b in sorted(table.points) if b >= per_rank]
        mns = fits[0] if fits else max(table.points)
    if args.graph_batch_sizes is not None:
        try:
            graph_sizes = tuple(sorted(int(x) for x in args.graph_batch_sizes.split(",")))
        except ValueError:
            raise PlanError(f"--graph-batch-sizes must be integers separated by commas, got "
                            f"{args.graph_batch_sizes!r}") from None
        try:
            rb.check_graph_sizes(list(graph_sizes))
        except rb.RebalanceError as e:
            raise PlanError(f"--graph-batch-sizes: {e}") from None
    else:
        graph_sizes = (mns,)
    if mns > graph_sizes[-1]:
        raise PlanError(f"--max-num-seqs {mns} exceeds the largest graph batch size {graph_sizes[-1]} "
                        f"(every running batch must have a captured graph)")
    table.check(graph_sizes)
    imb = None if args.max_imbalance is None else _float(args.max_imbalance, "--max-imbalance", 1.0, 1e9)
    policy = rb.RebalancePolicy(enabled=bool(args.rebalance),
                                min_graph_size_drop=_int(args.min_graph_size_drop, "--min-graph-size-drop", 1, 64),
                                max_imbalance=imb)
    lengths = src.sample(np.random.default_rng(seed), sequences, max_len)
    sc = Scenario(dp, mns, graph_sizes, policy, prompt_len, table)
    given = simulate(sc, lengths, tail)
    rec = None if args.no_recommend else recommend(sc, lengths, min_gain, tail)
    return {"inputs": {"dp": dp, "responses": sequences, "max_len": max_len, "prompt_len": prompt_len,
                       "lengths": src.describe, "length_mean": float(lengths.mean()),
                       "length_max": int(lengths.max()), "length_clip_ratio": float((lengths >= max_len).mean()),
                       "tpot": table.source, "max_num_seqs": mns, "seed": seed},
            "fit": src.fit or None, "given": given, "recommendation": rec}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = plan(args)
        given, rec = out["given"], out["recommendation"]
        shown = [given] + ([rec.baseline, rec.best] if rec else [])
        unique = list({(r.scenario.graph_sizes, r.scenario.policy): r for r in shown}.values())  # one line each
        if not args.no_png:
            _png(Path(args.png), unique)
    except (PlanError, rb.RebalanceError) as e:
        print(f"error: rollout-plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"inputs": out["inputs"], "fit": out["fit"], "given": given.as_dict()}
        if rec:
            doc["recommendation"] = {
                "graph_batch_sizes": list(rec.best.scenario.graph_sizes), "max_num_seqs": rec.max_num_seqs,
                "rebalance": rec.best.scenario.policy.enabled,
                "rebalance_min_graph_size_drop": rec.best.scenario.policy.min_graph_size_drop,
                "baseline": rec.baseline.as_dict(), "graph_sizes_only": rec.graph_sizes_only.as_dict(),
                "best": rec.best.as_dict(), "speedup": rec.baseline.total_s / rec.best.total_s
                if rec.best.total_s > 0 else 1.0, "simulations": rec.tried, "note": rec.note}
        print(json.dumps(doc, indent=2))
        return 0
    i = out["inputs"]
    print(f"rollout-plan: {i['responses']} responses on DP{i['dp']} (max_num_seqs {i['max_num_seqs']}), "
          f"prompt {i['prompt_len']} tokens, responses up to {i['max_len']}: {i['lengths']} "
          f"(sample mean {i['length_mean']:,.0f}, max {i['length_max']}, {i['length_clip_ratio']:.1%} at the cap); "
          f"TPOT: {i['tpot']}")
    print("given:")
    print("\n".join(_report(given)))
    if rec:
        b = rec.best.scenario
        print("default (one graph of max_num_seqs, no rebalance):")
        print("\n".join(_report(rec.baseline)))
        if rec.graph_sizes_only is not rec.baseline:
            print("recommended graph sizes without rebalance:")
            print("\n".join(_report(rec.graph_sizes_only)))
        print("recommended:")
        print("\n".join(_report(rec.best)))
        speed = rec.baseline.total_s / rec.best.total_s if rec.best.total_s > 0 else 1.0
        print(f"recommendation ({rec.tried} simulations): graph_batch_sizes {list(b.graph_sizes)}, max_num_seqs "
              f"{rec.max_num_seqs}, recipe.rebalance {str(b.policy.enabled).lower()}"
              + (f", recipe.rebalance_min_graph_size_drop {b.policy.min_graph_size_drop}" if b.policy.enabled else "")
              + f": {rec.baseline.total_s:,.0f} s -> {rec.best.total_s:,.0f} s ({speed:.2f}x)"
              + (f"; {rec.note}" if rec.note else ""))
    if not args.no_png:
        print(f"figure: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
