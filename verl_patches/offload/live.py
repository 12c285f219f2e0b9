"""The switch as one loop: ``our_steps()`` (offload/schedule.py) run on the live memory objects as
verl's calls reach them. The whole order is that one tuple; the preflight rehearses it on stand-in
groups and the tests compare the live ledger with it.

Each wrapper only says which step verl's call reaches (docs/DESIGN.md section 3):

    verl 0.4.1's call (ActorRolloutRefWorker, its sharding manager, vllm.LLM)   step
    generate_sequences, entering                       begin_rollout() (the rollout segment starts)
    LLM.wake_up(tags=["weights"])                      alloc_rollout_weights
    the sharding manager's weight sync                 reshard (its call)
    after the weight sync                              offload_train_params
    LLM.wake_up(tags=["kv_cache"])                     init_kv_cache
    generation                                         generate (verl runs it; passed)
    LLM.sleep, and generate_sequences leaving          release_rollout_weights
    compute_ref_log_prob                               ref_onload, ref_forward (its call), ref_offload
    update_actor                                       update_onload, update (its call), update_end

The switch runs every step from where it is up to the one reached, so a step that no wrapper
reaches (a sharding manager that does not offload the training params itself) still runs, in
order. Rules:
- A step whose groups are all absent in this process, and whose call nobody gives, is not part
  of this process's loop (a process without a reference model has no ref steps).
- ``reshard`` and ``generate`` run inside verl's own bodies: passing them without their call checks
  their preconditions. Passing ``update`` or ``ref_forward`` without their call is an error.
- Reaching a step that already ran in this iteration does nothing (the sharding manager's exit
  and the worker's generate_sequences both reach release_rollout_weights).
- The rollout segment (alloc_rollout_weights .. release_rollout_weights) repeats: validation
  generates right after a generation (before training starts, and after an update before the
  next step's generation). Repeating it first brings back the training params the reshard reads.
- The old log-prob forward and the checkpoints are excursions: what they read comes to the device
  and goes back where the loop had it; the position does not move.
- The loop starts where an update ends: memory attached before the first step is put where the
  steps so far leave it (the rollout engine's weights and KV cache released, the reference on
  host, the grads released). That is also what the engine's build-time sleep amounts to.
- On a device (not on the CPU platform) each ledger entry carries the allocator's allocated and
  reserved peaks since the previous entry ended, so verl's work between two reached steps counts
  in the next one (the generation in ``generate``, which runs when the release is reached); the
  sharding manager sends them to the run's report (``switch/mem/<step>/...``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

from verl_patches import accelerator
from verl_patches.offload.groups import Location, OffloadGroup
from verl_patches.offload.ledger import LedgerEntry, MemoryLedger
from verl_patches.offload.schedule import (OUR_INITIAL, ROLES, Action, ScheduleError, StepSpec, SwitchSchedule,
                                           locations_after, our_steps, step_roles)

# Call steps whose work runs inside verl's own bodies, between two reached steps.
VERL_RUNS = ("reshard", "generate")
ROLLOUT_SEGMENT = ("alloc_rollout_weights", "release_rollout_weights")
# What a repeated rollout segment needs back first: the reshard reads the training params.
REENTRY = (Action("onload", "train_params"),)
_TO = {Location.HOST: ("onload", "offload"), Location.RELEASED: ("allocate", "release")}
_PLACE = {Location.HOST: "offload", Location.RELEASED: "release"}


def _passed(*_args: Any) -> None:
    """The hook of a call step that verl's own body ran."""


class LiveSwitch(SwitchSchedule):
    """``our_steps()`` over the groups of the attached memory objects (each has ``groups()``:
    role -> OffloadGroup, and ``engine``); see the module docstring for the rules."""

    def __init__(self, *, keep_grads: bool = False, empty_cache: bool = True,
                 steps: Sequence[StepSpec] | None = None) -> None:
        # SwitchSchedule's fields, set here: the groups are the members' (a property), not a mapping given once.
        self.steps = tuple(steps if steps is not None else our_steps(keep_grads=keep_grads, empty_cache=empty_cache))
        self.name, self.hooks, self.ledger = "live", {}, MemoryLedger()
        self.initial, self.prepared = dict(OUR_INITIAL), True
        self.measure_device = accelerator.device_type() != "cpu"
        self.keep_grads = keep_grads
        self.members: list[Any] = []
        self.engine: Any = None
        self._names = [s.name for s in self.steps]
        self._restart()

    def _restart(self) -> None:
        # Where an update ends: update_end has run.
        self.index, self.iteration, self.started = self._at("update_end") + 1, 0, False

    def _measure_begin(self) -> None:
        """Nothing: the peaks run from the previous entry's end (verl's work between steps counts)."""

    def _measure_end(self) -> tuple[int | None, int | None, int | None]:
        out = super()._measure_end()
        if self.measure_device:
            accelerator.reset_peak_memory_stats()
        return out

    @property
    def groups(self) -> dict[str, OffloadGroup]:  # type: ignore[override]
        out: dict[str, OffloadGroup] = {}
        for m in self.members:
            out.update(m.groups())
        return out

    def _at(self, step: str) -> int:
        if step not in self._names:
            raise ScheduleError(f"the switch loop has no step {step!r}; its steps: {self._names}")
        return self._names.index(step)

    # -- memory objects ------------------------------------------------------------------
    def attach(self, memory: Any) -> None:
        """Put ``memory``'s groups under the loop, where the steps so far leave them. The host
        buffers the steps copy into are reserved first, in one check (HostMemoryError before
        anything moves)."""
        mine = memory.groups()
        unknown = set(mine) - set(ROLES)
        taken = set(mine) & set(self.groups)
        if unknown or taken:
            raise ScheduleError(f"cannot attach {type(memory).__name__}: "
                                + (f"unknown roles {sorted(unknown)} (roles are {ROLES})" if unknown
                                   else f"roles {sorted(taken)} already belong to an attached memory"))
        if getattr(memory, "keep_grads", self.keep_grads) != self.keep_grads:
            raise ScheduleError(f"{type(memory).__name__}.keep_grads={memory.keep_grads} but the switch loop's "
                                f"steps were built with keep_grads={self.keep_grads}")
        engine = getattr(memory, "engine", None)
        if self.engine is not None and engine is not None and engine is not self.engine:
            # One pool: its host-memory check must see every buffer at once.
            raise ScheduleError(f"{type(memory).__name__} uses another offload engine than the switch's; use "
                                "verl_patches.rollout.engine_memory.shared_offload_engine()")
        copied = {a.target for s in self.steps for a in s.actions if a.kind in ("offload", "onload")}
        copied = sorted(r for r in mine if r in copied)
        if engine is not None and copied:
            engine.pool.check({mine[r].name: mine[r].host_nbytes for r in copied})
        for r in copied:
            mine[r].reserve_host()
        self.engine = self.engine or engine
        self.members.append(memory)
        where = locations_after(self.steps, self.initial, self.index)
        place = tuple(Action(_PLACE[where[r]], r) if where[r] in _PLACE else Action("allocate", r)
                      for r, g in mine.items() if g.location is not where[r])
        if place:
            self._run(StepSpec(f"attach:{type(memory).__name__}", place), {})

    def detach(self, memory: Any) -> None:
        """Take ``memory`` out (it is being closed); with nothing left the loop starts over."""
        self.members = [m for m in self.members if m is not memory]
        if not self.members:
            self.engine = None
            self._restart()

    # -- verl's calls ----------------------------------------------------------------------
    def _effective(self, spec: StepSpec, hooks: dict[str, Callable]) -> bool:
        calls = {a.target for a in spec.actions if a.kind == "call"}
        return bool(calls & set(hooks)) or bool(step_roles(spec) & set(self.groups))

    def _may_wrap_to(self, t: int) -> bool:
        """True when no step of this process's loop lies between the position and step ``t``
        going round (so reaching ``t`` again is the next iteration, not a repeat)."""
        path = list(range(self.index, len(self.steps))) + list(range(0, t))
        return not any(self._effective(self.steps[i], {}) for i in path)

    def _unrun(self, spec: StepSpec, hooks: dict[str, Callable]) -> list[str]:
        """The calls of ``spec`` that nobody gives and verl does not run itself."""
        if not self._effective(spec, hooks):
            return []
        return [a.target for a in spec.actions if a.kind == "call" and a.target not in hooks
                and a.target not in VERL_RUNS]

    def _step(self, hooks: dict[str, Callable]) -> LedgerEntry | None:
        spec = self.steps[self.index]
        entry = None
        if self._effective(spec, hooks):
            passed = {a.target: _passed for a in spec.actions if a.kind == "call" and a.target not in hooks}
            hooks = {**hooks, **passed}
            self._check(spec, hooks)
            entry = self._run(spec, hooks)
        self.index += 1
        if self.index == len(self.steps):
            self.index, self.iteration = 0, self.iteration + 1
        return entry

    def reach(self, step: str, caller: str = "", **hooks: Callable) -> list[LedgerEntry]:
        """Run the loop up to and including ``step`` (nothing if it already ran in this iteration)."""
        t = self._at(step)
        self.started = True
        if t < self.index and not self._may_wrap_to(t):
            return []
        path = list(range(self.index, t + 1)) if t >= self.index else \
            list(range(self.index, len(self.steps))) + list(range(0, t + 1))
        for i in path:  # before anything moves
            missing = self._unrun(self.steps[i], hooks if i == t else {})
            if missing:
                raise ScheduleError(
                    f"{caller or 'a call'} reached step {step!r}, past step {self.steps[i].name!r}, whose work "
                    f"(hook {missing[0]!r}) has not run: the switch loop is at {self.state!r}; its order is "
                    f"{self._names}")
        out = []
        for i in path:
            entry = self._step(hooks if i == t else {})
            if entry is not None:
                out.append(entry)
        return out

    def call(self, step: str, fn: Callable[[], Any], caller: str = "") -> Any:
        """Run the loop up to ``step`` and ``fn`` as that step's call; return what ``fn`` returns."""
        t = self._at(step)
        if t < self.index and not self._may_wrap_to(t):
            raise ScheduleError(f"{caller or 'a call'} reached step {step!r}, which already ran in this iteration "
                                f"(the loop is at {self.state!r}; its order is {self._names})")
        (target,) = [a.target for a in self.steps[t].actions if a.kind == "call"]
        result: list[Any] = []
        self.reach(step, caller, **{target: lambda *_a: result.append(fn())})
        return result[0]

    def begin_rollout(self, caller: str = "generate_sequences") -> None:
        """The rollout segment starts: from where an update (or the loop's start) left off, or
        again right after a generation, bringing back what the reshard reads first."""
        start, end = (self._at(s) for s in ROLLOUT_SEGMENT)
        self.started = True
        if self.index == end + 1:
            back = tuple(a for a in REENTRY if a.target in self.groups)
            if back:
                self._run(StepSpec("rollout_again", back), {})
            self.index = start
        elif self.index > start and not self._may_wrap_to(start):
            raise ScheduleError(f"{caller} started a generation while the switch loop is at {self.state!r}: verl's "
                                "loop generates after an update, or again right after a generation (validation); "
                                f"the order is {self._names}")
        if self.index != start:  # update_end, if no update_actor reached it
            self.reach(self.steps[start - 1].name, caller)

    @contextlib.contextmanager
    def excursion(self, name: str, roles: Sequence[str]) -> Iterator[None]:
        """What ``roles`` hold comes to the device for the body and goes back after (also on error)."""
        groups = self.groups
        away = {r: groups[r].location for r in roles if r in groups and groups[r].location is not Location.DEVICE}
        if away:
            self._run(StepSpec(f"{name}:in", tuple(Action(_TO[loc][0], r) for r, loc in away.items())), {})
        try:
            yield
        finally:
            if away:
                self._run(StepSpec(f"{name}:out", tuple(Action(_TO[loc][1], r) for r, loc in away.items())), {})


_LIVE: LiveSwitch | None = None


def live_switch() -> LiveSwitch:
    """The process's switch loop (actor, reference and rollout engine share one process)."""
    global _LIVE
    if _LIVE is None:
        _LIVE = LiveSwitch()
    return _LIVE


def reset_live_switch() -> LiveSwitch:
    """A fresh loop for the process (tests that build several workers in one process)."""
    global _LIVE
    _LIVE = LiveSwitch()
    return _LIVE


__all__ = ["LiveSwitch", "REENTRY", "ROLLOUT_SEGMENT", "VERL_RUNS", "live_switch", "reset_live_switch"]
