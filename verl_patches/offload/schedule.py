"""The train/rollout switch as an explicit state machine (docs/DESIGN.md section 3), and
upstream verl 0.4.1's order as a baseline run by the same machine and the same ledger.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from verl_patches.base import accelerator
from verl_patches.offload.groups import Location, OffloadGroup
from verl_patches.offload.ledger import LedgerEntry, MemoryLedger

# Group roles the steps refer to. train_params and rollout_weights are required; a missing
# optional role (e.g. no optimizer group when MindSpeed swaps the optimizer) is skipped.
ROLES = ("train_params", "grads", "optimizer", "ref_params", "rollout_weights", "kv_cache")
REQUIRED_ROLES = ("train_params", "rollout_weights")
# Hooks the steps call: reshard(train_params_group, rollout_weights_group); the others take
# no argument.
HOOKS = ("reshard", "generate", "ref_forward", "train")


class ScheduleError(RuntimeError):
    """A step's precondition does not hold, or the schedule is misconfigured."""


@dataclass(frozen=True)
class Action:
    """``kind``: offload | onload | release | allocate (on a group role), call (a hook),
    empty_cache. ``force_copy``: offload even a read-only group whose host copy is exact
    (what upstream does). ``zero``: fill allocated memory with zeros."""

    kind: str
    target: str = ""
    force_copy: bool = False
    zero: bool | None = None

    def __str__(self) -> str:
        return f"{self.kind}({self.target})" if self.target else self.kind


@dataclass(frozen=True)
class StepSpec:
    name: str
    actions: tuple[Action, ...]
    requires: tuple[tuple[str, Location], ...] = ()  # checked before the step runs
    why: str = ""


def _a(kind: str, target: str = "", **kw) -> Action:
    return Action(kind, target, **kw)


_DEV = Location.DEVICE


def our_steps(*, keep_grads: bool = False, empty_cache: bool = True) -> tuple[StepSpec, ...]:
    """docs/DESIGN.md section 3, steps 1-9. Training params move out once and in once per
    iteration; rollout weights and KV cache are never copied; the reference model is copied
    to host once and afterwards only released. ``keep_grads`` copies grads instead of
    releasing them (only needed if gradients must survive the switch)."""
    grads_out = _a("offload", "grads") if keep_grads else _a("release", "grads")
    grads_in = _a("onload", "grads") if keep_grads else _a("allocate", "grads", zero=True)
    after_train = (_a("empty_cache"),) if empty_cache else ()
    return (
        StepSpec("update_end", (grads_out, _a("offload", "optimizer")),
                 why="grads and optimizer state leave; training params stay for the reshard"),
        StepSpec("alloc_rollout_weights", (_a("allocate", "rollout_weights"),),
                 why="allocate only: the reshard fills every byte"),
        StepSpec("reshard", (_a("call", "reshard"),),
                 requires=(("train_params", _DEV), ("rollout_weights", _DEV))),
        StepSpec("offload_train_params", (_a("offload", "train_params"),) + after_train,
                 why="training params leave before the KV cache is sized"),
        StepSpec("init_kv_cache", (_a("allocate", "kv_cache"),),
                 why="the KV cache takes the memory the training params freed"),
        StepSpec("generate", (_a("call", "generate"),),
                 requires=(("rollout_weights", _DEV), ("kv_cache", _DEV))),
        StepSpec("free_kv_cache", (_a("release", "kv_cache"),)),
        StepSpec("release_rollout_weights", (_a("release", "rollout_weights"),),
                 why="no copy: next iteration's reshard rebuilds them"),
        StepSpec("ref_onload", (_a("onload", "ref_params"),)),
        StepSpec("ref_forward", (_a("call", "ref_forward"),), requires=(("ref_params", _DEV),)),
        StepSpec("ref_offload", (_a("offload", "ref_params"),),
                 why="read-only: the host copy is still exact, so this only frees"),
        StepSpec("update_onload", (_a("onload", "train_params"), grads_in, _a("onload", "optimizer"))),
        StepSpec("update", (_a("call", "train"),),
                 requires=(("train_params", _DEV), ("grads", _DEV), ("optimizer", _DEV))),
    )


def baseline_steps(*, kv_before_reshard: bool = True) -> tuple[StepSpec, ...]:
    """Upstream verl 0.4.1 (megatron_workers + MegatronVLLMShardingManager) with param, grad
    and optimizer offload: the update offloads everything; the sharding manager onloads the
    training params *and* grads, wakes vLLM's weights (copying back the host copy that
    sleep(level=1) made, only to overwrite it), wakes the KV cache, reshards, offloads the
    params again; after generation sleep(level=1) copies the rollout weights to host. The
    reference model is copied out after every forward.

    ``kv_before_reshard=True`` is the order in the issue (wake_up weights, wake_up kv cache,
    sleep): what verl does when vLLM's wake_up takes no tags, waking both at once.
    ``False``: verl 0.4.1 with a tag-aware wake_up (vLLM 0.9.1), which wakes the KV cache
    after the param offload; its extra peak is then the grads it onloads for the reshard.
    """
    kv = StepSpec("wake_up_kv_cache", (_a("allocate", "kv_cache"),))
    return (
        StepSpec("update_end", (_a("offload", "train_params"), _a("release", "grads"), _a("offload", "optimizer")),
                 why="offload_megatron_model_to_cpu + offload_megatron_optimizer"),
        StepSpec("onload_train_params", (_a("onload", "train_params"), _a("allocate", "grads", zero=True)),
                 why="load_megatron_model_to_gpu(load_grad=True) in the sharding manager"),
        StepSpec("wake_up_weights", (_a("onload", "rollout_weights"),),
                 why="vLLM wake_up(weights): copies back the sleep(level=1) host copy"),
        *((kv,) if kv_before_reshard else ()),
        StepSpec("reshard", (_a("call", "reshard"),),
                 requires=(("train_params", _DEV), ("rollout_weights", _DEV))),
        StepSpec("offload_train_params", (_a("offload", "train_params"), _a("release", "grads"), _a("empty_cache"))),
        *(() if kv_before_reshard else (kv,)),
        StepSpec("generate", (_a("call", "generate"),),
                 requires=(("rollout_weights", _DEV), ("kv_cache", _DEV))),
        StepSpec("sleep", (_a("offload", "rollout_weights"), _a("release", "kv_cache")),
                 why="vLLM sleep(level=1): weights copied to host, KV cache discarded"),
        StepSpec("ref_onload", (_a("onload", "ref_params"),)),
        StepSpec("ref_forward", (_a("call", "ref_forward"),), requires=(("ref_params", _DEV),)),
        StepSpec("ref_offload", (_a("offload", "ref_params", force_copy=True),),
                 why="param.data.to('cpu') every time"),
        StepSpec("update_onload", (_a("onload", "train_params"), _a("allocate", "grads", zero=True),
                                   _a("onload", "optimizer"))),
        StepSpec("update", (_a("call", "train"),),
                 requires=(("train_params", _DEV), ("grads", _DEV), ("optimizer", _DEV))),
    )


# Where each schedule expects the groups when an iteration starts (the end of an update).
OUR_INITIAL = {"train_params": Location.DEVICE, "grads": Location.DEVICE, "optimizer": Location.DEVICE,
               "ref_params": Location.HOST, "rollout_weights": Location.RELEASED,
               "kv_cache": Location.RELEASED}
BASELINE_INITIAL = dict(OUR_INITIAL, rollout_weights=Location.HOST)


def step_roles(spec: StepSpec) -> set[str]:
    """The group roles a step moves or requires."""
    return {a.target for a in spec.actions if a.target in ROLES} | {role for role, _ in spec.requires}


_AFTER = {"offload": Location.HOST, "onload": Location.DEVICE, "release": Location.RELEASED,
          "allocate": Location.DEVICE}


def locations_after(steps: Sequence[StepSpec], initial: Mapping[str, Location], count: int) -> dict[str, Location]:
    """Where each role is after the first ``count`` steps, from ``initial`` (no group is touched)."""
    where = dict(initial)
    for spec in steps[:count]:
        for a in spec.actions:
            if a.kind in _AFTER and a.target in ROLES:
                where[a.target] = _AFTER[a.kind]
    return where


class StepRunner:
    """Runs one step's actions on the groups and records the step in the ledger: the one place a switch
    step moves memory. Shared, by composition, by SwitchSchedule (a fixed set of groups, one
    ``advance()`` per step: the preflight, the benchmarks) and verl_patches.offload.live.LiveSwitch (the
    process's loop over the memory objects attached to it, driven by verl's calls).

    ``groups`` is called for the role -> group mapping at each use (a fixed mapping, or the attached
    members'). ``peaks``: ``"step"`` resets the device's peak statistics when a step starts, so an
    entry's peaks are its own actions'; ``"since_previous"`` resets them when an entry ends, so an
    entry's peaks also cover the work that ran between the previous entry and it (verl's own, between
    two reached steps). ``measure_device``: allocator statistics per entry (default: off on CPU).
    """

    PEAKS = ("step", "since_previous")

    def __init__(self, groups: Callable[[], Mapping[str, OffloadGroup]], *, name: str,
                 ledger: MemoryLedger | None = None, measure_device: bool | None = None,
                 peaks: str = "step") -> None:
        if peaks not in self.PEAKS:
            raise ScheduleError(f"step runner {name!r}: peaks={peaks!r}; expected one of {self.PEAKS}")
        self._groups = groups
        self.name = name
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.measure_device = accelerator.device_type() != "cpu" if measure_device is None else measure_device
        self.peaks = peaks

    @property
    def groups(self) -> Mapping[str, OffloadGroup]:
        return self._groups()

    def locations(self) -> dict[str, Location]:
        return {r: g.location for r, g in self.groups.items()}

    def resident(self) -> dict[str, int]:
        return {r: g.device_bytes() for r, g in self.groups.items()}

    def check(self, spec: StepSpec, hooks: Mapping[str, Callable]) -> None:
        """Every call of ``spec`` has its hook, every required group is where ``spec`` needs it."""
        groups = self.groups
        for a in spec.actions:
            if a.kind == "call" and a.target not in hooks:
                raise ScheduleError(f"schedule {self.name!r}, step {spec.name!r}: hook {a.target!r} not given "
                                    f"(pass it to advance()/run_iteration() or to hooks=)")
        for role, loc in spec.requires:
            g = groups.get(role)
            if g is not None and g.location is not loc:
                raise ScheduleError(f"schedule {self.name!r}, step {spec.name!r}: group {role!r} must be "
                                    f"{loc.value}, is {g.location.value}")

    def _do(self, a: Action, hooks: Mapping[str, Callable]) -> tuple[int, int]:
        groups = self.groups
        if a.kind == "call":
            fn = hooks[a.target]
            if a.target == "reshard":
                fn(groups.get("train_params"), groups.get("rollout_weights"))
            else:
                fn()
            return 0, 0
        if a.kind == "empty_cache":
            accelerator.empty_cache()
            return 0, 0
        g = groups.get(a.target)
        if g is None:
            return 0, 0
        if a.kind == "offload":
            return 0, (g.offload(force_copy=True) if a.force_copy else g.offload())
        if a.kind == "onload":
            return g.onload(), 0
        if a.kind == "release":
            return 0, g.release()
        if a.kind == "allocate":
            return g.allocate(a.zero), 0
        raise ScheduleError(f"unknown action {a}")

    def _measure_begin(self) -> None:
        """A step's allocator statistics start here (``peaks="step"``: the peak of the step's own actions)."""
        if self.measure_device and self.peaks == "step":
            accelerator.synchronize()
            accelerator.reset_peak_memory_stats()

    def _measure_end(self) -> tuple[int | None, int | None, int | None]:
        """(allocated now, allocated peak, reserved peak) of the device; Nones when not measured. With
        ``peaks="since_previous"`` the next entry's peaks start here."""
        if not self.measure_device:
            return None, None, None
        accelerator.synchronize()
        out = accelerator.memory_allocated(), accelerator.max_memory_allocated(), accelerator.max_memory_reserved()
        if self.peaks == "since_previous":
            accelerator.reset_peak_memory_stats()
        return out

    def run(self, spec: StepSpec, hooks: Mapping[str, Callable], iteration: int) -> LedgerEntry:
        """Run one step's actions and record them; on failure record the true residency and re-raise."""
        self._measure_begin()
        t0 = time.perf_counter()
        res = self.resident()
        peak, peak_res = sum(res.values()), res
        h2d = d2h = 0
        error: BaseException | None = None
        try:
            for a in spec.actions:
                up, down = self._do(a, hooks)
                h2d, d2h = h2d + up, d2h + down
                res = self.resident()
                if sum(res.values()) > peak:
                    peak, peak_res = sum(res.values()), res
        except BaseException as exc:  # noqa: BLE001 - recorded, then re-raised unchanged
            error = exc
        measured, measured_peak, reserved_peak = self._measure_end()
        res = self.resident()
        entry = LedgerEntry(schedule=self.name, iteration=iteration, step=spec.name, resident=res,
                            total=sum(res.values()), step_peak=max(peak, sum(res.values())),
                            step_peak_resident=peak_res, h2d_bytes=h2d, d2h_bytes=d2h,
                            seconds=time.perf_counter() - t0, measured_allocated=measured,
                            measured_peak=measured_peak, measured_reserved_peak=reserved_peak,
                            error=None if error is None else f"{type(error).__name__}: {error}")
        self.ledger.record(entry)
        if error is not None:
            error.add_note(f"switch schedule {self.name!r}: step {spec.name!r} failed and was not "
                           f"completed; groups: {({r: l.value for r, l in self.locations().items()})}; "
                           "advance() retries it")
            raise error
        return entry


class RunsSteps:
    """What a step order run through a StepRunner shows, shared by SwitchSchedule and the live loop
    (offload/live.py): ``self.runner``, ``self.steps`` and ``self.index`` are the owner's."""

    runner: StepRunner
    steps: Sequence[StepSpec]
    index: int

    @property
    def name(self) -> str:
        return self.runner.name

    @property
    def ledger(self) -> MemoryLedger:
        return self.runner.ledger

    @property
    def measure_device(self) -> bool:
        return self.runner.measure_device

    @measure_device.setter
    def measure_device(self, on: bool) -> None:
        self.runner.measure_device = on

    @property
    def state(self) -> str:
        """Name of the step that runs next."""
        return self.steps[self.index].name

    @property
    def step_names(self) -> list[str]:
        return [s.name for s in self.steps]

    def locations(self) -> dict[str, Location]:
        return self.runner.locations()

    def resident(self) -> dict[str, int]:
        return self.runner.resident()


class SwitchSchedule(RunsSteps):
    """Runs ``steps`` in order over a fixed set of groups, one ``advance()`` per step, wrapping around
    per iteration; each step through a StepRunner (shared with the live loop).

    Before the first step ``prepare()`` reserves every host buffer the steps can need
    (HostMemoryError, naming needed and available bytes, before anything moves) and puts the
    groups where the schedule starts. After each action the ledger samples every group's
    resident bytes. If a step raises, the position does not move, the ledger records the
    failure with the true residency, every group is wholly on device or on host (group
    actions are all-or-nothing and idempotent), and ``advance()`` retries the step.
    """

    def __init__(self, groups: Mapping[str, OffloadGroup], steps: Sequence[StepSpec] | None = None,
                 name: str = "ours", hooks: dict[str, Callable] | None = None, ledger: MemoryLedger | None = None,
                 initial: Mapping[str, Location] | None = None, measure_device: bool | None = None,
                 index: int = 0, iteration: int = 0, prepared: bool = False) -> None:
        self.groups = groups
        self.steps = tuple(our_steps() if steps is None else steps)
        self.hooks = dict(hooks or {})
        self.initial = dict(OUR_INITIAL) if initial is None else initial
        self.index, self.iteration, self.prepared = index, iteration, prepared
        unknown = set(self.groups) - set(ROLES)
        if unknown:
            raise ScheduleError(f"schedule {name!r}: unknown group roles {sorted(unknown)}; roles are {ROLES}")
        missing = [r for r in REQUIRED_ROLES if r not in self.groups]
        if missing:
            raise ScheduleError(f"schedule {name!r}: missing required groups {missing}")
        engines = {id(g.engine) for g in self.groups.values() if getattr(g, "engine", None) is not None}
        if len(engines) > 1:
            # One pool per schedule: the host-memory check must see every buffer at once.
            raise ScheduleError(f"schedule {name!r}: groups use {len(engines)} offload engines; use one")
        self.runner = StepRunner(lambda: self.groups, name=name, ledger=ledger, measure_device=measure_device)

    def __repr__(self) -> str:
        return (f"SwitchSchedule(name={self.name!r}, roles={sorted(self.groups)}, at={self.state!r}, "
                f"iteration={self.iteration})")

    # -- running -----------------------------------------------------------------------
    def prepare(self) -> None:
        """Reserve host buffers for every copied group, then move groups to ``initial``."""
        copied = {a.target for s in self.steps for a in s.actions
                  if a.kind in ("offload", "onload") and a.target in self.groups}
        copied |= {r for r, loc in self.initial.items() if loc is Location.HOST and r in self.groups}
        requests = {self.groups[r].name: self.groups[r].host_nbytes for r in sorted(copied)}
        # One check for all groups: fail before the first byte moves or the first buffer is pinned.
        pool = self._pool()
        if pool is not None:
            pool.check(requests)
        for r in sorted(copied):
            self.groups[r].reserve_host()
        for role, loc in self.initial.items():
            g = self.groups.get(role)
            if g is None or g.location is loc:
                continue
            if loc is Location.HOST:
                g.offload()
            elif loc is Location.RELEASED:
                g.release()
            elif g.location is Location.HOST:
                g.onload()
            else:
                g.allocate()
        self.prepared = True

    def _pool(self):
        for g in self.groups.values():
            eng = getattr(g, "engine", None)
            if eng is not None:
                return eng.pool
        return None

    def advance(self, **hooks: Callable) -> LedgerEntry:
        """Run the next step; return its ledger entry. On failure: record, stay, re-raise."""
        if not self.prepared:
            self.prepare()
        spec = self.steps[self.index]
        all_hooks = {**self.hooks, **hooks}
        self.runner.check(spec, all_hooks)
        entry = self.runner.run(spec, all_hooks, self.iteration)
        self.index += 1
        if self.index == len(self.steps):
            self.index = 0
            self.iteration += 1
        return entry

    def run_until(self, step: str, **hooks: Callable) -> list[LedgerEntry]:
        """Run steps up to and including ``step``."""
        if step not in self.step_names:
            raise ScheduleError(f"schedule {self.name!r} has no step {step!r}; steps: {self.step_names}")
        out = []
        while True:
            name = self.state
            out.append(self.advance(**hooks))
            if name == step:
                return out

    def run_iteration(self, **hooks: Callable) -> list[LedgerEntry]:
        """Run from the current step to the end of the iteration (a whole one from the start)."""
        return self.run_until(self.steps[-1].name, **hooks)


def ours(groups: Mapping[str, OffloadGroup], **kw) -> SwitchSchedule:
    """Our schedule over ``groups`` (kw: hooks, ledger, keep_grads, empty_cache, ...)."""
    step_kw = {k: kw.pop(k) for k in ("keep_grads", "empty_cache") if k in kw}
    return SwitchSchedule(groups, our_steps(**step_kw), name=kw.pop("name", "ours"),
                          initial=dict(OUR_INITIAL), **kw)


def baseline(groups: Mapping[str, OffloadGroup], *, kv_before_reshard: bool = True, **kw) -> SwitchSchedule:
    """Upstream verl 0.4.1's order over the same kind of groups (see baseline_steps)."""
    return SwitchSchedule(groups, baseline_steps(kv_before_reshard=kv_before_reshard),
                          name=kw.pop("name", "baseline"), initial=dict(BASELINE_INITIAL), **kw)
