"""The switch as one loop: ``our_steps()`` (offload/schedule.py) run on the live memory objects as
verl's calls reach them. The whole order is that one tuple; the preflight rehearses it on stand-in
groups and the tests compare the live ledger with it. The loop owns the process's offload engine
(``offload_engine()``), which every memory object under it shares, and runs each step through
schedule.py's StepRunner, as the preflight's SwitchSchedule does.

Each wrapper only says which step verl's call reaches: ``CALLS`` below, one row per wrapped call,
read by the wrappers (``LiveSwitch.run_call``), checked against them by
tests/offload/test_switch_calls.py, and rendered in docs/DESIGN.md section 3 (``calls_markdown``).

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
- Every step run that is not a stage's own work (``STAGE_WORK``) is a phase of the switch for the run's profiles
  (recipe.profile, verl_patches/base/profile.py): a named range in a stage's trace, or a trace of its own.
- On a device (not on the CPU platform) each ledger entry carries the allocator's allocated and
  reserved peaks since the previous entry ended, so verl's work between two reached steps counts
  in the next one (the generation in ``generate``, which runs when the release is reached); the
  sharding manager sends them to the run's report (``switch/mem/<step>/...``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from verl_patches.base import profile
from verl_patches.offload.groups import Location, OffloadGroup
from verl_patches.offload.ledger import LedgerEntry
from verl_patches.offload.schedule import (OUR_INITIAL, ROLES, Action, RunsSteps, ScheduleError, StepRunner, StepSpec,
                                           locations_after, our_steps, step_roles)
from verl_patches.offload.pool import OffloadEngine

# Call steps whose work runs inside verl's own bodies, between two reached steps.
VERL_RUNS = ("reshard", "generate")
# The calls that are a profiled stage's own work (recipe.profile: rollout, ref_log_prob, update), profiled as
# that stage; every other step the loop runs (the moves, the reshard) is a phase of the switch
# (verl_patches/base/profile.py).
STAGE_WORK = ("generate", "ref_forward", "train")
ROLLOUT_SEGMENT = ("alloc_rollout_weights", "release_rollout_weights")
# What a repeated rollout segment needs back first: the reshard reads the training params.
REENTRY = (Action("onload", "train_params"),)
_TO = {Location.HOST: ("onload", "offload"), Location.RELEASED: ("allocate", "release")}
_PLACE = {Location.HOST: "offload", Location.RELEASED: "release"}

# -- the call -> step table -------------------------------------------------------------------

WORKER = "ActorRolloutRefWorker"
SHARDING_ENTER = "MegatronVLLMShardingManager.__enter__"
WEIGHT_SYNC = "the sharding manager's weight sync"
WAKE_TAGS = ("weights", "kv_cache")  # vllm.LLM.wake_up's tags: one row each


def wake_call(tag: str) -> str:
    """The row of ``LLM.wake_up(tags=[tag])``."""
    return f"LLM.wake_up(tags=[{tag!r}])"


@dataclass(frozen=True)
class SwitchCall:
    """One wrapped call of verl 0.4.1 (its worker, its sharding manager, ``vllm.LLM``) and the loop's steps.

    ``name``: the call as errors and the docs name it. ``patch``: the patch whose wrapper makes the
    call. ``reaches``: the steps the wrapper reaches, in order (reaching a step runs every step before
    it that has not run); ``runs``: the one of them that verl's own body runs as (its call), if any.
    ``begins_rollout``: the call first (re)starts the rollout segment (``begin_rollout``).
    ``excursion``: the roles the call brings to the device and puts back (no step moves).
    ``inside``: the call that makes this one (its wrapper orders them by the loop, ``calls_inside``).
    ``steps``: the ledger entries the call adds when verl makes its calls in the trainer's order (the
    rows' order, a checkpoint after the update, the resume before the first step): what the test
    checks the wrappers against."""

    name: str
    patch: str
    steps: tuple[str, ...]
    reaches: tuple[str, ...] = ()
    runs: str = ""
    begins_rollout: bool = False
    excursion: tuple[str, ...] = ()
    inside: str = ""

    def __post_init__(self) -> None:
        if self.runs and self.runs not in self.reaches:
            raise ScheduleError(f"switch call {self.name!r}: runs {self.runs!r}, which it does not reach")
        if self.excursion and (self.reaches or self.begins_rollout):
            raise ScheduleError(f"switch call {self.name!r}: an excursion reaches no step")


CALLS: tuple[SwitchCall, ...] = (
    SwitchCall(f"{WORKER}.generate_sequences, entering", "verl.megatron_worker.generate_offload", steps=(),
               begins_rollout=True),
    SwitchCall(wake_call("weights"), "vllm.llm.wake_up_to_onload", steps=("alloc_rollout_weights",),
               reaches=("alloc_rollout_weights",), inside=SHARDING_ENTER),
    SwitchCall(WEIGHT_SYNC, "verl.sharding_manager.reshard",
               steps=("reshard", "offload_train_params"), reaches=("reshard", "offload_train_params"),
               runs="reshard", inside=SHARDING_ENTER),
    SwitchCall(wake_call("kv_cache"), "vllm.llm.wake_up_to_onload", steps=("init_kv_cache",),
               reaches=("init_kv_cache",), inside=SHARDING_ENTER),
    SwitchCall("LLM.sleep", "vllm.llm.sleep_to_offload", steps=("generate", "free_kv_cache", "release_rollout_weights"),
               reaches=("release_rollout_weights",)),
    SwitchCall(f"{WORKER}.generate_sequences, leaving", "verl.megatron_worker.generate_offload", steps=(),
               reaches=("release_rollout_weights",)),
    SwitchCall(f"{WORKER}.compute_log_prob", "verl.megatron_worker.log_prob_onload",
               steps=("compute_log_prob:in", "compute_log_prob:out"), excursion=("train_params",)),
    SwitchCall(f"{WORKER}.compute_ref_log_prob", "verl.megatron_worker.ref_offload",
               steps=("ref_onload", "ref_forward", "ref_offload"), reaches=("ref_onload", "ref_forward", "ref_offload"),
               runs="ref_forward"),
    SwitchCall(f"{WORKER}.update_actor", "verl.megatron_worker.update_offload",
               steps=("update_onload", "update", "update_end"), reaches=("update_onload", "update", "update_end"),
               runs="update"),
    SwitchCall(f"{WORKER}.save_checkpoint", "verl.megatron_worker.save_checkpoint_onload",
               steps=("save_checkpoint:in", "save_checkpoint:out"), excursion=("train_params", "optimizer")),
    SwitchCall(f"{WORKER}.load_checkpoint", "verl.megatron_worker.load_checkpoint_onload",
               steps=("load_checkpoint:in", "load_checkpoint:out"), excursion=("train_params", "optimizer")),
)


def switch_call(name: str) -> SwitchCall:
    """The row of ``CALLS`` named ``name``."""
    for row in CALLS:
        if row.name == name:
            return row
    raise ScheduleError(f"no switch call {name!r}; the calls are {[c.name for c in CALLS]}")


def excursion_name(row: SwitchCall) -> str:
    """The prefix of an excursion's ledger entries: the method's name (``compute_log_prob:in``)."""
    return row.name.rsplit(".", 1)[-1]


def calls_inside(outer: str, steps: Sequence[StepSpec] | None = None) -> list[SwitchCall]:
    """The rows ``outer`` makes, in the loop's order (by the first step each reaches)."""
    names = [s.name for s in (steps if steps is not None else our_steps())]
    rows = [c for c in CALLS if c.inside == outer]
    return sorted(rows, key=lambda c: names.index(c.reaches[0]))


def calls_markdown() -> str:
    """``CALLS`` as the table docs/DESIGN.md shows (tests/offload/test_switch_calls.py checks it)."""
    out = ["| verl 0.4.1's call | patch | reaches (its call in bold) | steps run in the trainer's order |",
           "|---|---|---|---|"]
    for c in CALLS:
        if c.excursion:
            reach = "excursion: " + ", ".join(f"`{r}`" for r in c.excursion) + " to the device and back"
        else:
            reach = ", ".join(f"**`{s}`**" if s == c.runs else f"`{s}`" for s in c.reaches)
            if c.begins_rollout:
                reach = "begins the rollout segment" + (", then " + reach if reach else "")
        name = f"`{c.name}`" + (f" (in `{c.inside}`)" if c.inside else "")
        ran = ", ".join(f"`{s}`" for s in c.steps) or "nothing"
        out.append(f"| {name} | `{c.patch}` | {reach or 'nothing'} | {ran} |")
    return "\n".join(out) + "\n"


def _passed(*_args: Any) -> None:
    """The hook of a call step that verl's own body ran."""


class LiveSwitch(RunsSteps):
    """``our_steps()`` over the groups of the attached memory objects (each has ``groups()``:
    role -> OffloadGroup, and ``engine``), run through a StepRunner; see the module docstring for the
    rules. The loop owns the process's offload engine: given here, else the first attached memory's,
    else made by the first ``offload_engine()``."""

    def __init__(self, *, keep_grads: bool = False, empty_cache: bool = True,
                 steps: Sequence[StepSpec] | None = None, engine: Any = None) -> None:
        self.steps = tuple(steps if steps is not None else our_steps(keep_grads=keep_grads, empty_cache=empty_cache))
        self.initial = dict(OUR_INITIAL)
        self.keep_grads = keep_grads
        self.members: list[Any] = []
        self.engine: Any = engine
        # Peaks since the previous entry's end: verl's work between two reached steps counts in the next.
        self.runner = StepRunner(lambda: self.groups, name="live", peaks="since_previous")
        self._names = [s.name for s in self.steps]
        self._restart()

    def _restart(self) -> None:
        # Where an update ends: update_end has run.
        self.index, self.iteration, self.started = self._at("update_end") + 1, 0, False

    # -- introspection (the rest: schedule.RunsSteps) --------------------------------------
    @property
    def groups(self) -> dict[str, OffloadGroup]:
        """Role -> group over every attached memory object."""
        out: dict[str, OffloadGroup] = {}
        for m in self.members:
            out.update(m.groups())
        return out

    def _at(self, step: str) -> int:
        if step not in self._names:
            raise ScheduleError(f"the switch loop has no step {step!r}; its steps: {self._names}")
        return self._names.index(step)

    def _run(self, spec: StepSpec, hooks: dict[str, Callable]) -> LedgerEntry:
        if any(a.kind == "call" and a.target in STAGE_WORK for a in spec.actions):
            return self.runner.run(spec, hooks, self.iteration)
        with profile.phase(spec.name):  # a phase of the switch (recipe.profile's "switch" stage)
            return self.runner.run(spec, hooks, self.iteration)

    # -- memory objects ------------------------------------------------------------------
    def offload_engine(self) -> Any:
        """The process's one OffloadEngine: the training groups and the rollout engine's share its host
        pool and its storage registry (one storage, one owner, one host copy). Made on first use."""
        if self.engine is None:
            self.engine = OffloadEngine()
        return self.engine

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
                                "the switch loop's own, verl_patches.offload.live.live_switch().offload_engine()")
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
        """Take ``memory`` out (it is being closed); with nothing left the loop starts over (on the
        same engine: it is the process's)."""
        self.members = [m for m in self.members if m is not memory]
        if not self.members:
            self._restart()

    # -- verl's calls ----------------------------------------------------------------------
    def run_call(self, name: str, body: Callable[[], Any] | None = None) -> Any:
        """What the wrapper of ``CALLS`` row ``name`` does around verl's ``body`` (if given): an
        excursion around it, or (re)start the rollout segment, reach the row's steps in order and run
        ``body`` as its ``runs`` step. Returns what ``body`` returns (None without one)."""
        row = switch_call(name)
        if row.excursion:
            with self.excursion(excursion_name(row), row.excursion):
                return None if body is None else body()
        if row.begins_rollout:
            self.begin_rollout(row.name)
        out = None
        for step in row.reaches:
            if step == row.runs:
                if body is None:
                    raise ScheduleError(f"switch call {row.name!r} runs verl's body as step {step!r}: pass it")
                out = self.call(step, body, row.name)
            else:
                self.reach(step, row.name)
        if body is not None and not row.runs:
            out = body()
        return out

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
            self.runner.check(spec, hooks)
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


__all__ = ["CALLS", "LiveSwitch", "REENTRY", "ROLLOUT_SEGMENT", "SHARDING_ENTER", "STAGE_WORK", "SwitchCall",
           "VERL_RUNS", "WAKE_TAGS", "WEIGHT_SYNC", "WORKER", "calls_inside", "calls_markdown", "live_switch",
           "reset_live_switch", "switch_call", "wake_call"]
