"""The switch loop as verl's calls drive it (verl_patches/offload/live.py): the same steps as the
preflight's schedule (our_steps), the same residency at every step, the rollout segment repeated
for validation, excursions, and out-of-order calls refused by name. The groups are the scaled die
of offload_helpers (real TensorGroups on the offload engine); the workers' real bodies drive the
same loop in tests/patches/verl/test_megatron_worker_memory.py and in the tiny run."""

from __future__ import annotations

import pytest

from tests.offload.offload_helpers import ScaledDie, group_digests
from verl_patches.offload import HostBufferPool, Location, OffloadEngine, ScheduleError, our_steps, ours
from verl_patches.offload.live import LiveSwitch

ACTOR, REF, ROLLOUT = ("train_params", "grads", "optimizer"), ("ref_params",), ("rollout_weights", "kv_cache")


class Member:
    """A memory object as the workers attach them: some roles' groups, and the engine."""

    def __init__(self, die: ScaledDie, roles, engine) -> None:
        self._groups = {r: die.groups[r] for r in roles}
        self.engine = engine

    def groups(self):
        return dict(self._groups)


def die_and_engine(seed: int = 0):
    engine = OffloadEngine(pool=HostBufferPool(reserve_bytes=0), chunk_bytes=4096)
    return ScaledDie(engine, unit=256, seed=seed), engine


def attached(*parts, seed: int = 0):
    d, engine = die_and_engine(seed)
    switch = LiveSwitch()
    for roles in parts:
        switch.attach(Member(d, roles, engine))
    return d, switch


def generation(d: ScaledDie, switch: LiveSwitch) -> None:
    """generate_sequences as the recipe's worker, sharding manager and vLLM engine reach the loop."""
    switch.begin_rollout()
    switch.reach("alloc_rollout_weights", "LLM.wake_up(weights)")
    switch.call("reshard", lambda: d._reshard_and_remember(d.groups["train_params"], d.groups["rollout_weights"]))
    switch.reach("offload_train_params")
    switch.reach("init_kv_cache", "LLM.wake_up(kv_cache)")
    d.generate()  # verl's own generation: the loop passes it
    switch.reach("release_rollout_weights", "LLM.sleep")
    switch.reach("release_rollout_weights", "generate_sequences")  # already done: nothing


def training_step(d: ScaledDie, switch: LiveSwitch, *, validate: bool = False) -> None:
    generation(d, switch)
    with switch.excursion("compute_log_prob", ("train_params",)):
        assert d.groups["train_params"].location is Location.DEVICE
    switch.reach("ref_onload")
    switch.call("ref_forward", d.ref_forward)
    switch.reach("ref_offload")
    switch.reach("update_onload")
    switch.call("update", d.train)
    switch.reach("update_end")
    if validate:
        generation(d, switch)


def loop_entries(switch: LiveSwitch):
    names = set(s.name for s in switch.steps)
    return [e for e in switch.ledger.entries if e.step in names]


def test_verl_call_order_runs_our_steps_with_the_preflight_residency():
    d, switch = attached(ACTOR, REF, ROLLOUT)
    # Attached where the loop starts (an update's end): the rollout's memory released, the reference on host.
    assert switch.locations() == {"train_params": Location.DEVICE, "grads": Location.RELEASED,
                                  "optimizer": Location.HOST, "ref_params": Location.HOST,
                                  "rollout_weights": Location.RELEASED, "kv_cache": Location.RELEASED}
    for _ in range(3):
        training_step(d, switch)
    live = loop_entries(switch)
    names = [s.name for s in our_steps()]
    assert [e.step for e in live] == (names[1:] + names[:1]) * 3  # one loop, from where an update ends
    assert d.calls == {"reshard": 3, "generate": 3, "ref_forward": 3, "train": 3}

    # The preflight's schedule over an identical die: the same residency after every step.
    d2, _ = die_and_engine()
    pre = ours(d2.groups)
    pre.run_until("update_end", **d2.hooks())
    for _ in range(3):
        pre.run_until("update_end", **d2.hooks())
    rehearsed = [e for e in pre.ledger.entries][1:]
    assert [(e.step, e.resident) for e in live] == [(e.step, e.resident) for e in rehearsed]
    assert max(e.step_peak for e in live) == max(e.step_peak for e in rehearsed)


def test_validation_repeats_the_rollout_segment_with_the_training_params_back_first():
    d, switch = attached(ACTOR, REF, ROLLOUT)
    generation(d, switch)  # validation before training
    training_step(d, switch, validate=True)
    training_step(d, switch)
    again = [e for e in switch.ledger.entries if e.step == "rollout_again"]
    assert len(again) == 2  # before each training step's generation, after a validation's
    assert all(e.h2d_bytes == d.sizes["train_params"] for e in again)
    assert d.calls["reshard"] == 4 and d.calls["train"] == 2
    assert d.groups["train_params"].location is Location.DEVICE


def test_excursions_put_back_what_they_moved_even_on_error():
    d, switch = attached(ACTOR, REF, ROLLOUT)
    digest = group_digests(d.groups["train_params"])
    generation(d, switch)
    before = switch.locations()
    with pytest.raises(RuntimeError, match="boom"):
        with switch.excursion("save_checkpoint", ("train_params", "optimizer")):
            assert d.groups["optimizer"].location is Location.DEVICE
            raise RuntimeError("boom")
    assert switch.locations() == before and switch.state == "ref_onload"
    switch.reach("ref_onload")
    switch.call("ref_forward", d.ref_forward)
    switch.reach("update_onload")
    assert group_digests(d.groups["train_params"]) == digest


def test_out_of_order_calls_are_refused_by_name():
    d, switch = attached(ACTOR, REF, ROLLOUT)
    where = switch.locations()
    # An update with no generation and no reference forward since the last one: refused before anything moves.
    with pytest.raises(ScheduleError, match="update_actor reached step 'update_onload', past step 'ref_forward'"):
        switch.reach("update_onload", "update_actor")
    assert switch.locations() == where and switch.state == "alloc_rollout_weights"
    d, switch = attached(ACTOR, REF, ROLLOUT, seed=1)
    generation(d, switch)
    switch.reach("ref_onload")
    switch.call("ref_forward", d.ref_forward)
    with pytest.raises(ScheduleError, match="'ref_forward', which already ran"):
        switch.call("ref_forward", d.ref_forward, "compute_ref_log_prob")
    with pytest.raises(ScheduleError, match="started a generation while the switch loop is at 'ref_offload'"):
        switch.begin_rollout()
    with pytest.raises(ScheduleError, match="no step 'wake'"):
        switch.reach("wake")


def test_a_process_runs_only_the_steps_of_what_it_holds():
    # A process with the reference only: its three steps, round and round.
    d, switch = attached(REF)
    for _ in range(3):
        switch.reach("ref_onload")
        switch.call("ref_forward", d.ref_forward)
        switch.reach("ref_offload")
    assert [e.step for e in loop_entries(switch)] == ["ref_onload", "ref_forward", "ref_offload"] * 3
    # The rollout engine alone (vLLM's sleep / wake_up with no trainer): its segment, again and again.
    d, switch = attached(ROLLOUT, seed=1)
    for _ in range(2):
        switch.reach("alloc_rollout_weights")
        switch.reach("init_kv_cache")
        switch.reach("release_rollout_weights")
    assert [e.step for e in loop_entries(switch)] == ["alloc_rollout_weights", "reshard", "init_kv_cache",
                                                      "generate", "free_kv_cache", "release_rollout_weights"] * 2


def test_attaching_refuses_taken_roles_and_a_second_engine():
    d, switch = attached(ACTOR)
    engine = switch.engine
    with pytest.raises(ScheduleError, match=r"roles \['grads', 'optimizer', 'train_params'\] already belong"):
        switch.attach(Member(d, ACTOR, engine))
    d2, other = die_and_engine(1)
    with pytest.raises(ScheduleError, match="another offload engine"):
        switch.attach(Member(d2, REF, other))
    member = switch.members[0]
    switch.detach(member)
    assert switch.members == [] and switch.state == "alloc_rollout_weights" and not switch.started
