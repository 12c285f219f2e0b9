"""The switch loop's call -> step table (verl_patches/offload/live.py:CALLS) against the wrappers that
read it and the docs that show it.

The weight-sync patch's docstring lists __enter__ / __exit__ in order as ``sequence()`` renders them
from the table; the last tests check that the two agree.

The wrappers are the real ones: the Megatron worker's (patch_workers_megatron_workers_switch), the
sharding manager's part of __enter__ (enter_calls and weight_sync, what recipe_enter runs) and
vllm.LLM's sleep / wake_up (patch_entrypoints_llm), driven in verl's trainer order on the process's
switch loop. The bodies they wrap are stand-ins over offload_helpers' scaled die (real TensorGroups
on the offload engine): verl's worker bodies, the reshard and vLLM's generation cannot run on these
groups. The real bodies drive the same loop in tests/patches/verl/test_megatron_worker_memory.py
and the tiny run."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from tests.helpers import REPO
from tests.offload.test_live_switch import ACTOR, REF, ROLLOUT, Member, die_and_engine
from verl_patches.core import stash
from verl_patches.patches import get_patch
from verl_patches.offload import ScheduleError, our_steps
from verl_patches.offload.live import (CALLS, SHARDING_ENTER, WAKE_TAGS, WEIGHT_SYNC, WORKER, calls_inside,
                                       calls_markdown, reset_live_switch, switch_call, wake_call)
from verl_patches.patches.verl import patch_workers_megatron_workers_switch as worker_patch
from verl_patches.patches.verl import patch_workers_sharding_manager_megatron_vllm as sharding_patch
from verl_patches.patches.verl.patch_workers_sharding_manager_megatron_vllm import enter_calls, sequence, weight_sync
from verl_patches.patches.vllm.patch_entrypoints_llm import MEMORY_ATTR, wrap_sleep, wrap_wake_up

LOAD = f"{WORKER}.load_checkpoint"


def _vllm_sleep_mode(*_a, **_k):
    raise AssertionError("vLLM's own sleep mode was reached: the engine's memory is under the switch loop")


class _LLM:
    """vllm.LLM as the sharding manager sees it: sleep / wake_up are the real wrappers (over vLLM's
    sleep mode, which must not run), each call traced."""

    _wake_up = wrap_wake_up(_vllm_sleep_mode)
    _sleep = wrap_sleep(_vllm_sleep_mode)

    def wake_up(self, tags=None):
        (tag,) = tags  # the sharding manager wakes one tag at a time (patch verl.sharding_manager.reshard)
        return self.trace(wake_call(tag), lambda: self._wake_up(tags=tags))

    def sleep(self, level: int = 1):
        return self.trace("LLM.sleep", lambda: self._sleep(level))


class Trainer:
    """verl's calls in its trainer's order, each through its real wrapper. ``seen``: (row name, the
    ledger entries the call added), for every call of the table."""

    def __init__(self) -> None:
        self.d, engine = die_and_engine()
        self.switch = reset_live_switch()
        actor, ref, rollout = (Member(self.d, roles, engine) for roles in (ACTOR, REF, ROLLOUT))
        for m in (actor, ref, rollout):
            self.switch.attach(m)
        self.seen: list[tuple[str, list[str]]] = []
        self.worker = SimpleNamespace()
        stash.put(self.worker, "actor_memory", actor)
        stash.put(self.worker, "ref_memory", ref)
        llm = _LLM()
        llm.trace = self.traced
        setattr(llm, MEMORY_ATTR, rollout)
        self.manager = SimpleNamespace(inference_engine=llm, offload_param=False, actor_module=None)
        d = self.d

        def generate_sequences(worker, prompts):
            self.seen.append((f"{WORKER}.generate_sequences, entering", self._since(self._entered)))
            # MegatronVLLMShardingManager.__enter__ (recipe_enter's calls), generation, __exit__.
            reshard = lambda: d._reshard_and_remember(d.groups["train_params"], d.groups["rollout_weights"])  # noqa: E731
            enter_calls(self.manager, lambda: self.traced(WEIGHT_SYNC,
                                                           lambda: weight_sync(self.manager, self.switch, reshard)))
            d.generate()
            self.manager.inference_engine.sleep(level=1)
            self._left = len(self.switch.ledger.entries)
            return "batch"

        def compute_log_prob(worker, data):
            assert d.groups["train_params"].location.value == "device"
            return "old_log_prob"

        def compute_ref_log_prob(worker, data):
            d.ref_forward()
            return "ref_log_prob"

        def update_actor(worker, data):
            d.train()
            return "metrics"

        def save_checkpoint(worker, path):
            assert d.groups["optimizer"].location.value == "device"

        def load_checkpoint(worker, path):
            assert d.groups["optimizer"].location.value == "device"

        self.methods = {
            "generate_sequences": worker_patch.wrap_generate_sequences_offload(generate_sequences),
            "compute_log_prob": worker_patch.wrap_compute_log_prob_offload(compute_log_prob),
            "compute_ref_log_prob": worker_patch.wrap_compute_ref_log_prob_offload(compute_ref_log_prob),
            "update_actor": worker_patch.wrap_update_actor_offload(update_actor),
            "save_checkpoint": worker_patch.wrap_save_checkpoint(save_checkpoint),
            "load_checkpoint": worker_patch.wrap_load_checkpoint(load_checkpoint),
        }

    def _since(self, n: int) -> list[str]:
        return [e.step for e in list(self.switch.ledger.entries)[n:]]

    def traced(self, name: str, fn):
        n = len(self.switch.ledger.entries)
        out = fn()
        self.seen.append((name, self._since(n)))
        return out

    def call(self, method: str, arg=None):
        if method == "generate_sequences":
            self._entered = len(self.switch.ledger.entries)
            out = self.methods[method](self.worker, arg)
            self.seen.append((f"{WORKER}.generate_sequences, leaving", self._since(self._left)))
            return out
        return self.traced(f"{WORKER}.{method}", lambda: self.methods[method](self.worker, arg))

    def training_step(self) -> None:
        for method in ("generate_sequences", "compute_log_prob", "compute_ref_log_prob", "update_actor",
                       "save_checkpoint"):
            self.call(method)


def test_each_wrapped_call_runs_exactly_the_steps_of_its_row_in_order():
    t = Trainer()
    t.call("load_checkpoint")  # resuming, before the first step
    for _ in range(2):
        t.training_step()
    in_order = [c for c in CALLS if c.name != LOAD]
    want = [(LOAD, list(switch_call(LOAD).steps))] + [(c.name, list(c.steps)) for c in in_order] * 2
    assert t.seen == want
    # Every row was driven, and the loop ran whole: each step of our_steps once per training step.
    assert {name for name, _ in t.seen} == {c.name for c in CALLS}
    names = [s.name for s in our_steps()]
    loop = [e.step for e in t.switch.ledger.entries if e.step in names]
    assert loop == (names[1:] + names[:1]) * 2
    assert t.d.calls == {"reshard": 2, "generate": 2, "ref_forward": 2, "train": 2}


def test_the_table_names_real_steps_and_the_patches_that_wrap_each_call():
    names = [s.name for s in our_steps()]
    for c in CALLS:
        assert set(c.reaches) <= set(names), c.name
        if not c.excursion:
            assert set(c.steps) <= set(names), c.name
            # What a call reaches last is the last step it runs (when it runs any).
            assert not c.steps or c.steps[-1] == c.reaches[-1], c.name
        target = get_patch(c.patch).target.split(":", 1)[1]
        # The patched target is the call itself (ActorRolloutRefWorker.update_actor, LLM.sleep), or the
        # call it runs inside (the weight sync, in the sharding manager's __enter__).
        assert target == re.split(r"[,(]", c.name)[0] or (c.name == WEIGHT_SYNC and target == c.inside), c.name
    assert len({c.name for c in CALLS}) == len(CALLS)
    assert {switch_call(wake_call(t)).patch for t in WAKE_TAGS} == {"vllm.llm.wake_up_to_onload"}
    with pytest.raises(ScheduleError, match="no switch call 'LLM.wake'"):
        switch_call("LLM.wake")


def test_the_sharding_manager_makes_its_calls_in_the_loops_order():
    made = []
    manager = SimpleNamespace(inference_engine=SimpleNamespace(
        wake_up=lambda tags=None: made.append(wake_call(tags[0]))))

    def sync():
        made.append(WEIGHT_SYNC)
        return "stats"

    assert enter_calls(manager, sync) == "stats"
    assert made == [c.name for c in calls_inside(SHARDING_ENTER)] == [
        wake_call("weights"), WEIGHT_SYNC, wake_call("kv_cache")]
    # The order is read from the loop's steps, not restated: a loop that made the KV cache before
    # the reshard would have the manager wake it first.
    steps = list(our_steps())
    kv = next(s for s in steps if s.name == "init_kv_cache")
    steps.remove(kv)
    steps.insert([s.name for s in steps].index("alloc_rollout_weights"), kv)
    made.clear()
    enter_calls(manager, sync, steps)
    assert made == [wake_call("kv_cache"), wake_call("weights"), WEIGHT_SYNC]


DOC_BEGIN = "<!-- switch-calls: generated from verl_patches/offload/live.py:calls_markdown() -->"
DOC_END = "<!-- /switch-calls -->"


def test_the_design_doc_shows_the_table_from_the_data():
    text = (REPO / "docs" / "DESIGN.md").read_text()
    assert text.count(DOC_BEGIN) == 1 and text.count(DOC_END) == 1, "docs/DESIGN.md section 3 lost its table markers"
    shown = text.split(DOC_BEGIN, 1)[1].split(DOC_END, 1)[0].strip("\n") + "\n"
    assert shown == calls_markdown(), ("docs/DESIGN.md's call -> step table differs from live.py's CALLS; "
                                       "paste calls_markdown()'s output between the markers:\n" + calls_markdown())
    for c in CALLS:  # a row removed from the data must leave the doc too
        assert f"`{c.name}`" in shown


def test_the_weight_sync_patch_docstring_lists_its_calls_from_the_data():
    doc = sharding_patch.__doc__
    assert sequence() in doc, ("the weight-sync patch's docstring differs from the sequence the table gives; "
                               "paste sequence()'s output into it:\n" + sequence())
    # The calls __enter__ makes are numbered items in the order enter_calls makes them; LLM.sleep's under __exit__.
    enter, rest = doc.split("__enter__, recipe.reshard_method direct", 1)[1].split("__enter__, recipe.reshard_method "
                                                                                    "upstream", 1)
    at = [enter.index(f"\n{i}. `{c.name}`, step") for i, c in enumerate(calls_inside(SHARDING_ENTER), 3)]
    assert at == sorted(at)
    assert "\n1. `LLM.sleep`, steps" in rest.split("__exit__", 1)[1]
    # Rendered from the loop's steps, not restated: a loop that made the KV cache before the reshard lists it first.
    steps = list(our_steps())
    kv = next(s for s in steps if s.name == "init_kv_cache")
    steps.remove(kv)
    steps.insert([s.name for s in steps].index("alloc_rollout_weights"), kv)
    moved = sequence(steps)
    assert moved.index(f"3. `{wake_call('kv_cache')}`") < moved.index(f"5. `{WEIGHT_SYNC}`")
