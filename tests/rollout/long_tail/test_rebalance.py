"""The long-tail rebalance policy (verl_patches/rollout/long_tail/rebalance.py): the graph size each DP rank needs,
the smallest reachable graph size and the fewest moves that reach it (checked against a brute force over
every redistribution of the requests, on small cases drawn by hypothesis), the threshold, the restore
map, determinism, and the setting's reader. Pure Python; nothing stands in for anything."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings as hsettings, strategies as st
from omegaconf import OmegaConf

from verl_patches.config import settings
from verl_patches.rollout.long_tail import rebalance as rb
from verl_patches.config.settings import problems as recipe_problems

ON = rb.RebalancePolicy(enabled=True)


# ---------- (a) the graph size each rank needs ----------

def test_each_rank_needs_the_smallest_graph_size_that_holds_its_requests():
    layout = {0: [1, 2, 3], 1: [], 2: list(range(10, 18)), 3: [4]}
    assert rb.needed_graph_sizes(layout, [1, 2, 4, 8]) == {0: 4, 1: 1, 2: 8, 3: 1}
    assert rb.graph_size_for(0, (2, 4)) == 2  # an empty rank still steps, in the smallest graph
    assert rb.graph_size_for(4, (2, 4)) == 4


@pytest.mark.parametrize("layout,graph_sizes,match", [
    ({0: list(range(9))}, [4, 8], "9 unfinished requests exceed the largest graph batch size 8"),
    ({0: [1]}, [8, 4], "strictly increasing"),
    ({0: [1]}, [4, 4], "strictly increasing"),
    ({0: [1]}, [], "non-empty sorted list"),
    ({0: [1]}, "64", "non-empty sorted list"),
    ({0: [1]}, [0, 4], "graph batch size 0 is not a positive integer"),
    ({0: [1]}, [True, 4], "graph batch size True"),
    ({}, [4], "non-empty mapping"),
    ({-1: [1]}, [4], "DP rank -1"),
    ({0: [1], 1: [1]}, [4], "request id 1 is on rank 0 and rank 1"),
    ({0: [1, "a"]}, [4], "mix ints and strs"),
    ({0: "abc"}, [4], "request ids must be a list"),
    ({0: [1.5]}, [4], "request id 1.5 is not an int or a str"),
])
def test_malformed_input_is_named(layout, graph_sizes, match):
    with pytest.raises(rb.RebalanceError, match=match):
        rb.plan_moves(layout, graph_sizes)


def test_capacity_problems_are_named():
    with pytest.raises(rb.RebalanceError, match="rank 0 holds 3 requests, more than its capacity 2"):
        rb.plan_moves({0: [1, 2, 3], 1: []}, [4], capacity={0: 2})
    with pytest.raises(rb.RebalanceError, match="rank 1 holds 1 requests, more than its capacity 0"):
        rb.plan_moves({0: [1, 2], 1: [3]}, [2, 4], capacity={0: 2, 1: 0})
    with pytest.raises(rb.RebalanceError, match="3 unfinished requests do not fit 2 DP ranks"):
        rb.target_graph_size({0: 2, 1: 1}, [2, 4], capacity={0: 2, 1: 0})
    with pytest.raises(rb.RebalanceError, match="capacity -1"):
        rb.plan_moves({0: [1]}, [4], capacity=-1)


# ---------- (b) the plan, against a brute force ----------

def brute_force(counts: list[int], graph_sizes: list[int], caps: list[int]) -> tuple[int, int]:
    """(smallest graph size any redistribution reaches, fewest moves to reach it), by trying every
    vector of per-rank counts with the same total within the capacities."""
    total, best = sum(counts), None
    for new in itertools.product(*(range(c + 1) for c in caps)):
        if sum(new) != total:
            continue
        graph_size = next(b for b in graph_sizes if b >= max(new))
        moves = sum(max(0, a - b) for a, b in zip(counts, new))  # each move lowers one rank by one
        if best is None or (graph_size, moves) < best:
            best = (graph_size, moves)
    return best


@st.composite
def cases(draw):
    graph_sizes = sorted(draw(st.sets(st.integers(1, 6), min_size=1, max_size=4)))
    dp = draw(st.integers(1, 4))
    caps = [draw(st.integers(0, graph_sizes[-1])) for _ in range(dp)] if draw(st.booleans()) else None
    limit = caps or [graph_sizes[-1]] * dp
    counts = [draw(st.integers(0, c)) for c in limit]
    ids = iter(draw(st.permutations(range(sum(counts)))))
    layout = {r: [next(ids) for _ in range(c)] for r, c in enumerate(counts)}
    weights = {i: draw(st.integers(0, 3)) for ids_ in layout.values() for i in ids_} if draw(st.booleans()) else None
    return layout, graph_sizes, caps, weights


@hsettings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(case=cases())
def test_the_plan_reaches_the_smallest_graph_size_with_the_fewest_moves(case):
    layout, graph_sizes, caps, weights = case
    capacity = dict(enumerate(caps)) if caps else None
    counts = [len(v) for v in layout.values()]
    want_graph_size, want_moves = brute_force(counts, graph_sizes, caps or [graph_sizes[-1]] * len(counts))
    graph_size, moves = rb.plan_moves(layout, graph_sizes, capacity, weights)
    assert (graph_size, len(moves)) == (want_graph_size, want_moves)
    room = [min(graph_size, c) for c in (caps or [graph_sizes[-1]] * len(counts))]
    # The closed form of the docstring's proof.
    assert len(moves) == sum(max(0, c - r) for c, r in zip(counts, room))
    after = rb.apply_moves(layout, moves)
    assert all(len(after[r]) <= room[r] for r in after)
    assert max(rb.needed_graph_sizes(after, graph_sizes).values()) == graph_size
    assert sorted(i for v in after.values() for i in v) == sorted(i for v in layout.values() for i in v)
    moved = [m.request for m in moves]
    assert len(set(moved)) == len(moved)  # nothing moves twice
    assert not {m.src for m in moves} & {m.dst for m in moves}  # no rank both sends and receives
    # Deterministic: the same plan again, and whatever order the mapping lists the ranks in.
    assert rb.plan_moves(dict(reversed(list(layout.items()))), graph_sizes, capacity, weights) == (graph_size, moves)
    # The cheapest requests of a sender move (then the smallest ids).
    for r in {m.src for m in moves}:
        sent = [m.request for m in moves if m.src == r]
        key = (lambda i: ((weights or {}).get(i, 0), i))
        assert sorted(sent, key=key) == sorted(layout[r], key=key)[:len(sent)]


def test_a_worked_example_ties_by_rank_then_id():
    # 4 ranks, 10 requests: graph size 4 (4 x 4 >= 10) is the smallest reachable; rank 0 sends 3.
    layout = {0: [7, 3, 9, 1, 5, 8, 2], 1: [4], 2: [6], 3: [0]}
    graph_size, moves = rb.plan_moves(layout, [1, 2, 4, 8])
    assert graph_size == 4
    # Its smallest ids 1, 2, 3 to the ranks with the most room, the lowest rank first.
    assert moves == (rb.Move(1, 0, 1), rb.Move(2, 0, 2), rb.Move(3, 0, 3))


# ---------- the threshold ----------

@pytest.mark.parametrize("policy,layout,take,reason", [
    (rb.RebalancePolicy(), {0: list(range(8)), 1: []}, False, "rebalance is off"),
    (ON, {0: [1, 2], 1: [3, 4]}, False, "graph size 2 is already the smallest reachable"),
    (ON, {0: list(range(8)), 1: []}, True, "graph size 8 -> 4 (1 step(s) >= 1)"),
    (rb.RebalancePolicy(True, 2), {0: list(range(8)), 1: []}, False, "8 -> 4 is 1 step(s) < 2"),
    (rb.RebalancePolicy(True, 2, 1.5), {0: list(range(8)), 1: []}, True, "imbalance 2.00 > 1.5"),
    (rb.RebalancePolicy(True, 2, 3.0), {0: list(range(8)), 1: []}, False, "and imbalance 2.00 <= 3.0"),
    (rb.RebalancePolicy(True, 2), {0: list(range(8)), 1: [], 2: [], 3: []}, True, "graph size 8 -> 2 (2 step(s) >= 2)"),
])
def test_the_policy_rebalances_only_past_its_threshold(policy, layout, take, reason):
    d = rb.decide(layout, [1, 2, 4, 8], policy)
    assert d.rebalance is take and reason in d.reason
    assert bool(d.moves) is take
    assert d.graph_size_after == (d.target_graph_size if take else d.current_graph_size)
    assert rb.judge({r: len(v) for r, v in layout.items()}, [1, 2, 4, 8], policy).rebalance is take


# ---------- the restore map ----------

@hsettings(max_examples=100, derandomize=True, database=None, deadline=None)
@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=5), rounds=st.integers(0, 3), seed=st.integers(0, 99))
def test_every_output_goes_back_to_its_rank_in_its_order(counts, rounds, seed):
    rng = random.Random(seed)
    ids = iter(rng.sample(range(1000), sum(counts)))
    original = {r: [f"req{next(ids)}" for _ in range(c)] for r, c in enumerate(counts)}
    layout = original
    for _ in range(rounds):  # moved several times, by any plan
        flat = [(r, i) for r, v in layout.items() for i in v]
        moves = [rb.Move(i, r, rng.randrange(len(counts))) for r, i in rng.sample(flat, len(flat) // 2)]
        layout = rb.apply_moves(layout, moves)
    outputs = {r: [(i, f"out-{i}") for i in rng.sample(v, len(v))] for r, v in layout.items()}
    back = rb.restore(original, outputs)
    assert back == {r: [f"out-{i}" for i in v] for r, v in original.items()}


def test_restore_refuses_lost_duplicated_and_unknown_outputs():
    original = {0: ["a", "b"], 1: ["c"]}
    with pytest.raises(rb.RebalanceError, match=r"1 request\(s\) did not come back, e.g. \['c'\]"):
        rb.restore(original, {0: [("a", 1), ("b", 2)]})
    with pytest.raises(rb.RebalanceError, match="request 'a' came back twice"):
        rb.restore(original, {0: [("a", 1), ("b", 2)], 1: [("a", 3), ("c", 4)]})
    with pytest.raises(rb.RebalanceError, match="returned request 'z', which no rank started with"):
        rb.restore(original, {1: [("z", 1)]})
    with pytest.raises(rb.RebalanceError, match="the request is not there"):
        rb.apply_moves(original, [rb.Move("a", 1, 0)])


# ---------- the setting ----------

def test_the_setting_is_off_by_default_and_read_by_the_typed_reader():
    assert rb.RebalancePolicy.from_recipe(None) == rb.RebalancePolicy(False, 1, None)
    assert settings.KEYS["rebalance"].default is False
    cfg = OmegaConf.create({"rebalance": True, "rebalance_min_graph_size_drop": 2, "rebalance_max_imbalance": 1.5})
    assert rb.RebalancePolicy.from_recipe(cfg) == rb.RebalancePolicy(True, 2, 1.5)
    assert recipe_problems(cfg) == []


@pytest.mark.parametrize("section,match", [
    ({"rebalance": "true"}, "recipe.rebalance must be true or false, got the string 'true' (write true or false"),
    ({"rebalance_min_graph_size_drop": 0}, "recipe.rebalance_min_graph_size_drop must be >= 1, got 0"),
    ({"rebalance_max_imbalance": 0.5}, "recipe.rebalance_max_imbalance must be >= 1.0, got 0.5"),
    ({"rebalance_max_imbalance": "2"}, "recipe.rebalance_max_imbalance must be a positive number"),
])
def test_a_bad_setting_is_named(section, match):
    with pytest.raises(rb.RebalanceError) as e:
        rb.RebalancePolicy.from_recipe(section)
    assert match in str(e.value)
    # The YAML check the launchers run names it too.
    key = next(iter(section))
    assert any(f"recipe.{key}" in p for p in recipe_problems(section))
