"""The recipe's own settings: every key of ``actor_rollout_ref.rollout.recipe`` declared once, as a typed,
documented field of a frozen dataclass per feature group (``ReshardSettings``, ``SwitchSettings``,
``TrainingSettings``, ``RebalanceSettings``, ``MachineSettings``, ``ReportSettings``; the nested sections
``VllmDpSettings`` and ``ProfileSettings``), its default and rules beside it (``setting``); and one reader
that every patch, the launchers' checks and the config composition use. The tables the validator reads
(``KEYS``, ``VLLM_DP``, ``PROFILE``, ``SCHEMA``) and the tools' bucket default (``BUCKET_MB``) are derived
from those fields, never written twice. Booleans are read one way: a real true/false, anything else is an
error naming the key (a quoted "false" in YAML is a string, and truthy).

A patch reads the section once, as the run's typed, frozen ``RecipeSettings`` (``build``,
``from_worker``, ``from_trainer``, ``from_rollout``): the groups' fields are its own, flat, as the YAML
keys are (``settings.recipe.reshard_bucket_mb``), absent keys their default, every problem of the section
named at once. The rollout's settings (verl_patches/rollout/settings.py) hold it, and travel to the
sharding manager and the generation under one stash key (``rollout_settings``, on vLLM's LLM).

Two things are called "recipe" in this repository, and a third was; they are different:
- the *recipe section*: this YAML section (``actor_rollout_ref.rollout.recipe``), read here;
- the *run configs*: the YAML files under configs/ that compose a run (verl_patches/checks/recipe_config.py);
- the *reference recipe's reshard* (``reshard_method: alltoallv``, called ``recipe`` before issue 49):
  the published recipe's AlltoAllV, kept for comparison (``METHOD_DOCS`` below).
"""

from __future__ import annotations

import difflib
import math
import typing
from dataclasses import Field, dataclass, field, fields
from typing import Any, Mapping, Optional

from verl_patches.config.megatron_args import RecipeMegatron, RecipeMegatronError, parse as parse_megatron

SECTION = "actor_rollout_ref.rollout.recipe"  # in the trainer's config
SECTION_IN_WORKER = "rollout.recipe"  # in a worker's config (verl gives it actor_rollout_ref)
SECTION_IN_ROLLOUT = "recipe"  # in the rollout's config


class SettingsError(ValueError):
    """A recipe setting with the wrong type or an unknown name; the message names the key."""


@dataclass(frozen=True)
class Key:
    """One key as the readers and the validator judge it, derived from its field below (``KEYS``, ``VLLM_DP``,
    ``PROFILE``): never written by hand."""

    kind: Any  # bool, int, float, str, a tuple of allowed values, a section's own rule by name, or "section"
    default: Any
    doc: str
    minimum: Any = None  # numbers: the smallest value allowed (an int key without one: 0; a float key: above 0)
    maximum: Any = None  # numbers: the largest value allowed
    low_open: bool = False  # numbers: the value must lie above ``minimum``, not at it
    high_open: bool = False  # numbers: the value must lie below ``maximum``, not at it


def setting(default: Any, doc: str, *, choices: tuple[str, ...] | None = None, minimum: Any = None,
            maximum: Any = None, rule: str | None = None) -> Any:
    """A recipe key, declared as a field of its group: ``default`` is what an absent key (or null, or '???')
    means, ``doc`` what the key does. Its type is the field's annotation (Optional: null allowed); its rules
    sit beside it: ``choices`` (a string key's allowed values), ``minimum`` / ``maximum`` (a number's bounds;
    an int key without a minimum: 0), ``rule`` (a value its section's own reader checks, by name)."""
    return field(default=default, metadata={"doc": doc, "choices": choices, "minimum": minimum, "maximum": maximum,
                                            "rule": rule})


def subsection(factory: Any, doc: str) -> Any:
    """A nested section of the recipe (``vllm_dp``, ``profile``, ``megatron``), read by its own rules."""
    return field(default_factory=factory, metadata={"doc": doc, "section": True})


# The reshard methods (the ``reshard_method`` key): name -> what it is; one implementation each, chosen once by
# verl_patches/reshard/weight_sync.py (``for_method``).
METHOD_DOCS: dict[str, str] = {
    "direct": "ours: direct slice routing, one all-to-all per bucket, no full tensor materialised",
    "alltoallv": "the published recipe's reference: experts by a PP broadcast and one AlltoAllV in the expert group; "
              "dense tensors by a TP all-gather to full size and a PP all-to-all of them to every stage",
    "upstream": "verl 0.4.1's path: every parameter gathered to full size on every rank",
}
METHODS: tuple[str, ...] = tuple(METHOD_DOCS)

# Each default below is what the shipped run configs (configs/*.yaml) mean; where one differs, or the configs
# differ among themselves, its comment says why (tests/test_settings.py holds the list).


@dataclass(frozen=True)
class ReshardSettings:
    """The switch's weight transfer: how the trained weights reach vLLM, in what buckets, and how often the
    rollout's copy is proven equal to what was sent."""

    reshard_method: str = setting("direct", "how the trained weights reach vLLM (METHOD_DOCS above)", choices=METHODS)
    # The Ascend configs' value; the NVIDIA configs set 512, measured on H200 (docs/benchmarks.md, issue 37), while
    # no HCCL curve is measured yet. The planning tools take this default too (BUCKET_MB below).
    reshard_bucket_mb: int = setting(
        256, "the reshard's transfer bucket in MiB per rank (verl_patches/reshard/planner.py); two are in flight, so "
             "the switch's peak extra device memory is 2 x this (docs/benchmarks.md, issue 37: larger buckets bring "
             "the direct reshard closer to the all-to-all's large-message ceiling)", minimum=1, maximum=4096)
    # Every shipped config checks every switch (a check is under 1% of the reference switch, docs/benchmarks.md,
    # issue 37); before issue 49 the default was 10, from the older 6% figure.
    fingerprint_every: int = setting(
        1, "check every N switches that each rollout parameter holds exactly what the training side sent "
           "(verl_patches/reshard/checksum.py); 0: never", minimum=0)


@dataclass(frozen=True)
class SwitchSettings:
    """The train/rollout switch and the rollout engine: the recipe's behaviour by default, each one a key the
    YAML can turn off (a plain verl config gets the recipe's behaviour)."""

    tensor_cache: bool = setting(True, "keep stage outputs on the workers; the driver sends row ids")
    dp_sync_on_device: bool = setting(True, "vLLM's DP all-reduces on the device group instead of gloo")
    offload: bool = setting(True, "the recipe's switch schedule instead of verl's offload and vLLM's sleep mode")
    rollout_torch_compile: bool = setting(True, "the real torch.compile for the rollout under MindSpeed")


@dataclass(frozen=True)
class TrainingSettings:
    """The training side: megatron-core's DDP overlap and the benchmarks' forced routing."""

    # A real model's routing; the random-init configs set True (throughput benchmarks), the true-weight ones do not.
    fixed_routing: bool = setting(False, "load-balanced expert routing (random-init benchmarks)")
    # Every shipped config sets both True. The default stays verl's own DDP: the parameter gather's overlap needs
    # actor.megatron.use_distributed_optimizer (refused without it, verl_patches/train/ddp_overlap.py), which a verl
    # config without the recipe's section need not have.
    overlap_grad_reduce: bool = setting(
        False, "megatron-core's DDP launches each DDP bucket's gradient reduce from the backward hooks "
               "(verl_patches/train/ddp_overlap.py); false: verl's DDP")
    # Every shipped config sets True; false by default for overlap_grad_reduce's reason.
    overlap_param_gather: bool = setting(
        False, "megatron-core's DDP gathers the distributed optimizer's updated shards in the next forward's "
               "pre-hooks, finished when the update returns (verl_patches/train/ddp_overlap.py); false: in the "
               "optimizer step")


@dataclass(frozen=True)
class RebalanceSettings:
    """The rollout's long-tail rebalance (docs/ROLLOUT.md): the policy (verl_patches/rollout/long_tail/rebalance.py,
    also read by the planner) and the mechanism (verl_patches/rollout/long_tail/migrate.py), which only the CPU
    generation stand-in runs yet: on vLLM's engine (NPU, GPU) the rollout refuses rebalance: True."""

    rebalance: bool = setting(
        False, "move unfinished requests between DP ranks so the DP group drops to a smaller graph size, one of "
               "the captured graph_batch_sizes (the CPU generation stand-in only: vLLM's engine on a device does "
               "not implement the move yet and refuses it)")
    rebalance_min_graph_size_drop: int = setting(
        1, "rebalance only when it lowers the group's graph size by at least this many steps of graph_batch_sizes",
        minimum=1)
    rebalance_max_imbalance: Optional[float] = setting(
        None, "or, for a smaller drop, when the fullest DP rank holds more than this many times the mean; null: "
              "only the drop counts", minimum=1.0)
    rebalance_cpu_stagger: int = setting(
        0, "tests only, CPU generation stand-in: DP rank r admits its requests r x N decode steps late, forcing an "
           "uneven tail for rebalance to move (the outputs do not change); 0: off", minimum=0)


@dataclass(frozen=True)
class MachineSettings:
    """What the run's machines hold, for the launch-time memory check and the per-card throughput: no default
    fits every machine, and null skips the check."""

    # The machine's: the configs set 60 (an Ascend die), 139 (an H200), 79 (an H100).
    device_memory_gib: Optional[float] = setting(None, "the device's memory, to check the memory estimate against")
    # The machine's: the H100 configs set 1700, the others leave it null (unchecked).
    host_memory_gib: Optional[float] = setting(
        None, "the host memory of one node, to check the host side of the memory estimate against (the optimizer "
              "on the host and the switch's pinned copies)")
    devices_per_card: Optional[int] = setting(
        None, "devices (verl's GPUs: dies on Ascend) per card, for perf/tps_per_card; null: by trainer.device "
              "(npu 2, cuda 1; the CPU platform 1)")


@dataclass(frozen=True)
class ReportSettings:
    """Where the run's records go (verl_patches/reporting/)."""

    metrics_file: Optional[str] = setting(None, "the run's JSONL record (verl_patches/reporting/report.py)")
    tensorboard_dir: Optional[str] = setting(
        None, "where verl's tensorboard logger writes (its TENSORBOARD_DIR); null: verl's default, "
              "tensorboard_log/<project>/<experiment> under the driver's directory")


@dataclass(frozen=True)
class VllmDpSettings:
    """recipe.vllm_dp: vLLM data parallelism (verl_patches/rollout/dp_domain.py turns it into the DP domain)."""

    # The layout decides it: the common config leaves '???' and each run config sets its own.
    dp_size: Optional[int] = setting(None, "vLLM DP ranks per instance; null: every rank of an instance", minimum=1)
    # The run configs set 1, the 256-die true-weight one 2 (the common config leaves '???').
    instances: int = setting(1, "independent vLLM instances", minimum=1)
    master_port_base: int = setting(29600, "the first instance's DP master port", minimum=1, maximum=65535)
    port_stride: int = setting(4, "port distance between instances", minimum=1)


# The stages ``profile.stages`` may name: verl's worker calls (the rollout's generate_sequences, the old and the
# reference log-prob forwards, the actor's update) and the switch's phases (verl_patches/offload/live.py: every step
# of the switch loop that is not a stage's own work: the moves, the reshard).
PROFILE_STAGES = ("rollout", "old_log_prob", "ref_log_prob", "update", "switch")
# torch_npu's profiler levels (torch_npu.profiler.ProfilerLevel.Level0/1/2); on CUDA and the CPU the same names choose
# how much torch's profiler records (verl_patches/base/accelerator.py: profiler).
PROFILE_LEVELS = ("level0", "level1", "level2")


@dataclass(frozen=True)
class ProfileSettings:
    """recipe.profile, typed: ``stages`` and ``steps`` as tuples, ``ranks`` a tuple or "all" (the section's own
    rules: ``_profile_problems``). ``wants(stage, step, rank)``: whether that stage of that step is profiled on
    that rank."""

    stages: tuple[str, ...] = setting((), f"the stages to profile, of {list(PROFILE_STAGES)}; []: profiling off",
                                      rule="stages")
    # [first, last] of the trainer's global steps, both included.
    steps: tuple[int, int] = setting((1, 1), "[first, last] global step profiled (both included; steps count from 1)",
                                     rule="steps")
    ranks: tuple[int, ...] | str = setting((0,), "the global ranks that profile: a list of ranks, or \"all\"",
                                           rule="ranks")
    level: str = setting("level0", "how much the profiler records: torch_npu's ProfilerLevel on NPU; on CUDA and CPU "
                                   "level0 the ops, level1 also their shapes, level2 also stacks and memory",
                         choices=PROFILE_LEVELS)
    # The configs set ${trainer.default_local_dir}/profiles, the run's checkpoint directory: an interpolation of the
    # trainer's config, which no default here can name; null is refused only once stages are named.
    dir: Optional[str] = setting(None, "the traces' root: <dir>/step<N>/<stage>/rank<R>/ (needed when stages are "
                                       "named)")

    @classmethod
    def of(cls, section: Mapping[str, Any] | None) -> "ProfileSettings":
        values = _with_defaults(PROFILE, section or {})
        ranks = values["ranks"]
        return cls(stages=tuple(values["stages"]), steps=tuple(values["steps"]),
                   ranks=ranks if ranks == "all" else tuple(ranks), level=values["level"], dir=values["dir"])

    @property
    def on(self) -> bool:
        return bool(self.stages)

    def wants(self, stage: str, step: Any, rank: int) -> bool:
        return (stage in self.stages and isinstance(step, int) and self.steps[0] <= step <= self.steps[1]
                and (self.ranks == "all" or rank in self.ranks))


# The recipe section's groups, in reading order. The YAML keys stay flat (recipe.reshard_bucket_mb): the groups
# organise the code, RecipeSettings carries their fields as its own.
GROUPS: tuple[type, ...] = (ReshardSettings, SwitchSettings, TrainingSettings, RebalanceSettings, MachineSettings,
                            ReportSettings)


# A dataclass takes its bases' fields last base first: the bases are listed from the last group to the first so the
# fields read in GROUPS' order (checked below).
@dataclass(frozen=True)
class RecipeSettings(ReportSettings, MachineSettings, RebalanceSettings, TrainingSettings, SwitchSettings,
                     ReshardSettings):
    """The recipe section of one run, typed and frozen: every key of the groups above an attribute of its name
    (its default where the section has none), and the nested sections. Built by ``build``."""

    vllm_dp: VllmDpSettings = subsection(VllmDpSettings, "vLLM data parallelism: dp_size, instances, "
                                                         "master_port_base, port_stride")
    profile: ProfileSettings = subsection(ProfileSettings, "profile chosen stages for a step range on chosen ranks: "
                                                           "stages, steps, ranks, level, dir (PROFILE below; "
                                                           "verl_patches/base/profile.py); no stages: off")
    # MindSpeed's switches default false, as a machine without MindSpeed needs; the Ascend configs turn them on.
    megatron: RecipeMegatron = subsection(RecipeMegatron, "Megatron / MindSpeed settings "
                                                          "(verl_patches/config/megatron_args.py)")


def _key(spec: Field, hint: Any) -> Key:
    meta = spec.metadata
    if meta.get("section"):
        return Key("section", None, meta["doc"])
    if meta["rule"]:
        return Key(meta["rule"], spec.default, meta["doc"])
    args = typing.get_args(hint)
    nullable = type(None) in args
    kind = next(a for a in args if a is not type(None)) if nullable else hint
    if kind not in (bool, int, float, str) or (spec.default is None and not nullable) \
            or (meta["choices"] is not None and kind is not str):
        raise TypeError(f"recipe key {spec.name}: annotation {hint} does not fit its default {spec.default!r} "
                        f"and choices {meta['choices']}")
    return Key(meta["choices"] or kind, spec.default, meta["doc"], meta["minimum"], meta["maximum"])


def _table(cls: type) -> dict[str, Key]:
    hints = typing.get_type_hints(cls)
    return {spec.name: _key(spec, hints[spec.name]) for spec in fields(cls)}


def _check_groups() -> None:
    grouped = [spec.name for group in GROUPS for spec in fields(group)]
    own = [spec.name for spec in fields(RecipeSettings)]
    if len(set(grouped)) != len(grouped) or own[:len(grouped)] != grouped:
        raise TypeError(f"RecipeSettings' fields {own} are not the groups' {grouped} in order, each once")


_check_groups()

# The tables the readers, the validator and the docs take, derived from the declarations above.
KEYS: dict[str, Key] = _table(RecipeSettings)
VLLM_DP: dict[str, Key] = _table(VllmDpSettings)
PROFILE: dict[str, Key] = _table(ProfileSettings)
# The type of each key: a type, a tuple of allowed values, a nested section, or "megatron"
# (checked by verl_patches.config.megatron_args.parse).
SCHEMA: dict[str, Any] = {
    **{name: key.kind for name, key in KEYS.items() if key.kind != "section"},
    "vllm_dp": {name: key.kind for name, key in VLLM_DP.items()},
    "profile": {name: key.kind for name, key in PROFILE.items()},
    "megatron": "megatron",
}

# The reshard's bucket where a tool sizes it (``plan``, ``preflight``, scripts/bench_reshard.py) or a caller leaves it
# out (the planner's build_plan, WeightSync.build): the run's default, one declaration. The tools' --bucket-mb takes
# MiB in [TOOL_BUCKET_MB_LOW, TOOL_BUCKET_MB_HIGH], wider than the run's whole 1..4096: a bucket of a few KiB splits a
# tiny model into many buckets (tests/reshard/test_plan.py), and planning a larger one costs metadata only.
BUCKET_MB: int = KEYS["reshard_bucket_mb"].default
BUCKET_BYTES: int = BUCKET_MB << 20
TOOL_BUCKET_MB_LOW = 1 / 1024
TOOL_BUCKET_MB_HIGH = float(1 << 20)


def _describe(value: Any) -> str:
    return f"the string {value!r}" if isinstance(value, str) else f"{value!r} ({type(value).__name__})"


def _problem(spec: Key, value: Any, here: str) -> str | None:
    """What is wrong with ``value`` for a key of type ``spec`` (named ``here``), or None. The one set of
    type rules: the run-time reader and the launch-time validator both use it. None and '???' (a value
    the run config must set) are not judged here."""
    kind = spec.kind
    if value is None or value == "???" or kind == "section":
        return None
    if isinstance(kind, tuple):
        return None if value in kind else f"{here} must be one of {list(kind)}, got {_describe(value)}"
    if kind is bool:
        if isinstance(value, bool):
            return None
        hint = " (write true or false without quotes)" if isinstance(value, str) else ""
        return f"{here} must be true or false, got {_describe(value)}{hint}"
    if kind is str:
        return None if isinstance(value, str) else f"{here} must be a string (a path), got {_describe(value)}"
    if kind is float:
        # A float key without a minimum is a size or a factor: above 0.
        low, low_open = (0, True) if spec.minimum is None else (spec.minimum, spec.low_open)
        positive = low > 0 or (low == 0 and low_open)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return f"{here} must be a {'positive' if positive else 'finite'} number, got {_describe(value)}"
        if spec.minimum is None and not value > 0:
            return f"{here} must be a positive number, got {_describe(value)}"
        return _range_problem(spec, low, low_open, value, here)
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{here} must be an integer, got {_describe(value)}"
    return _range_problem(spec, 0 if spec.minimum is None else spec.minimum, spec.low_open, value, here)


def _range_problem(spec: Key, low: Any, low_open: bool, value: Any, here: str) -> str | None:
    """``value`` (a finite number) outside [low, spec.maximum] (each end open where the key says so), named."""
    high = spec.maximum
    below = value <= low if low_open else value < low
    above = high is not None and (value >= high if spec.high_open else value > high)
    if not (below or above):
        return None
    bound = "" if low == float("-inf") else f"{'>' if low_open else '>='} {low}"
    if high is not None:
        bound += (" and " if bound else "") + f"{'<' if spec.high_open else '<='} {high}"
    return f"{here} must be {bound}, got {value}"


def check_type(kind: Any, value: Any, here: str) -> Any:
    """``value`` if it has type ``kind`` (bool, int, float, str or a tuple of allowed values) by the rules
    above (a number may be any size: verl's own keys have their own bounds), else SettingsError naming
    ``here``: for a reader of verl's own keys next to the recipe's."""
    problem = _problem(Key(kind, None, "", minimum=float("-inf") if kind is int else None), value, here)
    if problem:
        raise SettingsError(problem)
    return value


def key_problem(spec: Key, value: Any, here: str) -> str | None:
    """What is wrong with ``value`` for a key declared as ``spec`` (named ``here``), or None: the rules above, for
    the declarations of verl's own keys (verl_patches/config/verl_keys.py) as for the recipe's."""
    return _problem(spec, value, here)


def check_value(key: str, value: Any, where: str = SECTION) -> Any:
    """``value`` for ``key`` if it has the key's type; else SettingsError naming ``where.key``."""
    if key not in KEYS:
        raise SettingsError(_renamed(key, where) or f"{where}.{key}: unknown key (known: {', '.join(sorted(KEYS))})")
    problem = _problem(KEYS[key], value, f"{where}.{key}")
    if problem:
        raise SettingsError(problem)
    return value


# Keys that were renamed: the old name is refused, naming the new one (never read beside it). Issue 38 gave the
# captured graph batch sizes their own name (graph size); "bucket" is the reshard's transfer bucket.
RENAMED: dict[str, str] = {"rebalance_min_bucket_drop": "rebalance_min_graph_size_drop"}


def _renamed(key: Any, where: str) -> Optional[str]:
    new = RENAMED.get(key) if isinstance(key, str) else None
    return None if new is None else (f"{where}.{key} was renamed {where}.{new} (same meaning, same values): "
                                     f"write {new} instead")


def _unknown(key: Any, known: Mapping[str, Any], here: str) -> str:
    where = here.rsplit(".", 1)[0]
    if known is SCHEMA and _renamed(key, where):
        return _renamed(key, where)
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"
    return f"{here}: unknown key{hint}"


def _megatron_problems(value: Any, here: str) -> list[str]:
    if not isinstance(value, Mapping):
        return [f"{here} must be a mapping, got {_describe(value)}"]
    try:
        parse_megatron(value)
    except RecipeMegatronError as e:
        return [str(e)]
    return []


def _int_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _profile_problems(value: Any, here: str) -> list[str]:
    """What is wrong with the ``profile`` section ``value`` (named ``here``): unknown keys, stages not in
    PROFILE_STAGES, steps not [first, last] with 1 <= first <= last, ranks not a list of ranks >= 0 or "all",
    a level not in PROFILE_LEVELS, a dir that is not a string, and stages named without a dir."""
    if not isinstance(value, Mapping):
        return [f"{here} must be a mapping of {sorted(PROFILE)}, got {_describe(value)}"]
    out: list[str] = []
    for sub, v in value.items():
        at = f"{here}.{sub}"
        spec = PROFILE.get(sub) if isinstance(sub, str) else None
        if spec is None:
            out.append(_unknown(sub, PROFILE, at))
        elif v is None or v == "???":
            continue
        elif sub == "stages":
            if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
                out.append(f"{at} must be a list of stage names of {list(PROFILE_STAGES)}, got {_describe(v)}")
            else:
                bad = [s for s in v if s not in PROFILE_STAGES]
                if bad:
                    out.append(f"{at}: unknown stage(s) {bad}; the stages are {list(PROFILE_STAGES)}")
                elif len(set(v)) != len(v):
                    out.append(f"{at} names a stage twice: {list(v)}")
        elif sub == "steps":
            if not _int_list(v) or len(v) != 2 or not 1 <= v[0] <= v[1]:
                out.append(f"{at} must be [first, last] global steps with 1 <= first <= last, got {_describe(v)}")
        elif sub == "ranks":
            if v != "all" and (not _int_list(v) or not v or min(v) < 0):
                out.append(f"{at} must be \"all\" or a non-empty list of global ranks (integers >= 0), "
                           f"got {_describe(v)}")
        else:
            problem = _problem(spec, v, at)
            out += [problem] if problem else []
    if not out and value.get("stages") and value.get("dir") in (None, "???"):
        out.append(f"{here}.dir is not set but {here}.stages names {list(value['stages'])}: name the directory the "
                   "traces go to (the recipe's configs set ${trainer.default_local_dir}/profiles)")
    return out


def problems(section: Any, where: str = SECTION) -> list[str]:
    """Every unknown key (with a did-you-mean), wrong type and string boolean in the recipe section
    ``section`` (a DictConfig, a mapping or None), named by its full key path; [] when it is
    well-formed. A '???' (a value the run config must set) is not judged here."""
    section = plain(section)
    if section is None:
        return []
    if not isinstance(section, Mapping):
        return [f"{where} must be a mapping of the recipe's keys, got {_describe(section)}"]
    out: list[str] = []
    for key, value in section.items():
        here = f"{where}.{key}"
        if not isinstance(key, str) or key not in SCHEMA:
            out.append(_unknown(key, SCHEMA, here))
        elif value is None or value == "???":
            continue
        elif key == "megatron":
            out += _megatron_problems(value, here)
        elif key == "profile":
            out += _profile_problems(value, here)
        elif key == "vllm_dp":
            if not isinstance(value, Mapping):
                out.append(f"{here} must be a mapping, got {_describe(value)}")
                continue
            for sub, v in value.items():
                spec = VLLM_DP.get(sub) if isinstance(sub, str) else None
                problem = _unknown(sub, VLLM_DP, f"{here}.{sub}") if spec is None else _problem(spec, v, f"{here}.{sub}")
                out += [problem] if problem else []
        else:
            problem = _problem(KEYS[key], value, here)
            out += [problem] if problem else []
    return out


def lookup(node: Any, path: str) -> Any:
    """The value at the dotted ``path`` of ``node`` (a DictConfig, a mapping, an object or None), as it is
    ('???' kept); None where a part is missing. The one lookup of the package's config readers."""
    for part in path.split("."):
        if node is None:
            return None
        try:
            node = node.get(part, None) if hasattr(node, "get") else getattr(node, part, None)
        except Exception as e:  # noqa: BLE001 - OmegaConf's MissingMandatoryValue ('???') without importing it
            if type(e).__name__ != "MissingMandatoryValue":
                raise
            return None
    return node


def _lookup(node: Any, path: str) -> Any:
    value = lookup(node, path)
    return None if value == "???" else value


def select(cfg: Any, key: str) -> Any:
    """``key`` (dotted) of a composed OmegaConf config, resolved; None where it is missing, '???' or an
    interpolation that does not resolve (the validator reports that as a bad value)."""
    # Lazy: OmegaConf only for a composed config; the patch modules import this module while the catalogue loads.
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(cfg, key, throw_on_missing=False)
    except Exception:  # noqa: BLE001 - an interpolation that does not resolve is reported as a bad value
        return None


def plain(node: Any) -> Any:
    """An OmegaConf node as plain dicts and lists ('???' kept as is); anything else unchanged."""
    if type(node).__name__ in ("DictConfig", "ListConfig"):
        # Lazy: OmegaConf only for a composed config; the patch modules import this module while the catalogue loads.
        from omegaconf import OmegaConf

        return OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
    return node


def read(section: Any, key: str, where: str = SECTION, check: bool = True) -> Any:
    """``key`` of the recipe section ``section`` (a DictConfig, a mapping or None), checked, or its default.
    ``check=False``: unchecked, for a reader that has reported ``problems(section)`` already."""
    value = _lookup(section, key)
    if check:
        check_value(key, value, where)
    elif key not in KEYS:
        raise SettingsError(_renamed(key, where) or f"{where}.{key}: unknown key (known: {', '.join(sorted(KEYS))})")
    return KEYS[key].default if value is None else value


def problem(key: str, value: Any, here: str) -> Optional[str]:
    """What is wrong with ``value`` for the recipe key ``key``, named ``here`` (a command-line option,
    say), or None: the key's own rules, for a reader that takes the value from elsewhere. None is a
    missing value there, refused for a key whose default is not None."""
    if value is None and KEYS[key].default is not None:
        return f"{here} must be set (default {KEYS[key].default!r}), got None"
    return _problem(KEYS[key], value, here)


def _with_defaults(table: Mapping[str, Key], values: Mapping[str, Any]) -> dict[str, Any]:
    return {name: spec.default if values.get(name) in (None, "???") else values[name] for name, spec in table.items()}


def build(section: Any, where: str = SECTION) -> RecipeSettings:
    """The recipe section ``section`` (a DictConfig, a mapping or None) as the run's RecipeSettings; every
    problem of the section in one SettingsError, each named by its key path under ``where``."""
    found = problems(section, where)
    if found:
        raise SettingsError("; ".join(found))
    section = plain(section) or {}
    scalars = _with_defaults({k: v for k, v in KEYS.items() if v.kind != "section"}, section)
    megatron = section.get("megatron")
    return RecipeSettings(**scalars, vllm_dp=VllmDpSettings(**_with_defaults(VLLM_DP, section.get("vllm_dp") or {})),
                          profile=ProfileSettings.of(section.get("profile")),
                          megatron=parse_megatron(None if megatron in (None, "???") else dict(megatron)))


def trainer_section(config: Any) -> Any:
    """The recipe section of the trainer's whole config (None where there is none)."""
    return _lookup(config, SECTION)


def from_worker(worker_config: Any) -> RecipeSettings:
    """The RecipeSettings of a worker's config (verl's actor_rollout_ref section)."""
    return build(_lookup(worker_config, SECTION_IN_WORKER))


def from_trainer(config: Any) -> RecipeSettings:
    """The RecipeSettings of the trainer's whole config."""
    return build(trainer_section(config))


def from_rollout(rollout_config: Any) -> RecipeSettings:
    """The RecipeSettings of the rollout's config (actor_rollout_ref.rollout)."""
    return build(_lookup(rollout_config, SECTION_IN_ROLLOUT))
