"""The keys of verl's own config that the recipe's run reads and a user edits (the optimizer, the algorithm, the
actor's loss, the rollout's sampling, the data's lengths and batch, the trainer's schedule), each declared once
with its rules (type, finite, range, null allowed or not) and what verl 0.4.1 does with it; and the relations
between them (``RELATIONS``: GRPO's group of at least two, the learning-rate schedule's order).

The launch-time validator (verl_patches/checks/recipe_config.py: ``verl_key_rules``) judges a composed config by
``problems``, every bad value named in one pass; the property tests generate bad values from ``KEYS`` and
``RELATIONS`` (``VerlKey.bad_values``, ``Relation.breaking``). The type rules are the recipe keys' own
(``settings.key_problem``). Keys whose rules verl's RayPPOTrainer._validate_config or the recipe's layout and batch
rules already hold (the micro batch sizes, the parallel layout, the token budgets) are not repeated here.

Ground floor: plain data and rules, no OmegaConf, no torch; a config is read through the ``select`` its caller
passes (a composed config's resolved values: an interpolation is judged by what it resolves to).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from verl_patches.config import settings

INF = float("inf")
A = "actor_rollout_ref.actor"
OPTIM = f"{A}.optim"
R = "actor_rollout_ref.rollout"


@dataclass(frozen=True)
class VerlKey:
    """One of verl's keys: its dotted path, its kind (int or float), what verl does with it, and its bounds
    (``settings.Key``'s: closed unless ``low_open`` / ``high_open``). ``nullable``: null is verl's own "unset"."""

    path: str
    kind: type
    doc: str
    minimum: Any = -INF
    maximum: Any = None
    low_open: bool = False
    high_open: bool = False
    nullable: bool = False

    @property
    def spec(self) -> settings.Key:
        return settings.Key(self.kind, None, self.doc, self.minimum, self.maximum, self.low_open, self.high_open)

    def problem(self, value: Any) -> Optional[str]:
        """What is wrong with ``value`` for this key, naming the key, the value and the rule; None if nothing."""
        if value is None or value == "???":
            return None if self.nullable else f"{self.path} must be set ({self.doc}), got null"
        found = settings.key_problem(self.spec, value, self.path)
        return f"{found} ({self.doc})" if found else None

    def bad_values(self) -> list[Any]:
        """Values this declaration refuses, generated from it: the wrong types, the non-finite numbers, a fraction
        for a whole number, each side of the range, and null where verl needs a value."""
        out: list[Any] = ["abc", True, [1], {"a": 1}]
        out += [1.5] if self.kind is int else [float("nan"), INF, -INF]
        if self.minimum != -INF:
            out.append(self.minimum if self.low_open else self.minimum - (1 if self.kind is int else 1e-3))
        if self.maximum is not None:
            out.append(self.maximum if self.high_open else self.maximum + (1 if self.kind is int else 1e-3))
        if not self.nullable:
            out.append(None)
        return out

    def good_value(self) -> Any:
        """A value the declaration accepts (the relations' tests build on it)."""
        low = 0 if self.minimum == -INF else self.minimum
        x = low + (1 if self.low_open or self.kind is int and low < 1 else 0)
        if self.maximum is not None and x >= self.maximum:
            x = self.maximum / 2 if self.high_open else self.maximum
        return int(x) if self.kind is int else float(x)


KEYS: tuple[VerlKey, ...] = (
    # The optimizer (verl's get_megatron_optimizer and megatron-core's OptimizerParamScheduler).
    VerlKey(f"{OPTIM}.lr", float, "megatron-core's Adam peak learning rate (the scheduler's max_lr)", 0,
            low_open=True),
    VerlKey(f"{OPTIM}.min_lr", float, "the scheduler's floor; megatron-core asserts min_lr >= 0", 0),
    VerlKey(f"{OPTIM}.lr_warmup_init", float, "the scheduler's first learning rate; megatron-core asserts >= 0 "
                                              "through init_lr <= max_lr", 0),
    VerlKey(f"{OPTIM}.lr_warmup_steps_ratio", float,
            "verl sets warmup steps = ratio x decay steps when lr_warmup_steps is unset; megatron-core asserts "
            "warmup < decay steps", 0, 1, high_open=True, nullable=True),
    VerlKey(f"{OPTIM}.weight_decay", float, "megatron-core's decoupled weight decay; its scheduler asserts >= 0", 0),
    VerlKey(f"{OPTIM}.clip_grad", float, "megatron-core clips the global gradient norm to it; 0 switches clipping "
                                         "off (a negative value would too, silently)", 0),
    # The actor's loss (verl's MegatronPPOActor.update_policy and core_algos.compute_policy_loss).
    VerlKey(f"{A}.clip_ratio", float, "PPO's clip: ratio clamped to [1 - low, 1 + high], each defaulting to it", 0,
            low_open=True),
    VerlKey(f"{A}.clip_ratio_low", float, "PPO's lower clip (null: clip_ratio)", 0, low_open=True, nullable=True),
    VerlKey(f"{A}.clip_ratio_high", float, "PPO's upper clip (null: clip_ratio)", 0, low_open=True, nullable=True),
    VerlKey(f"{A}.clip_ratio_c", float, "dual-clip PPO's bound; verl asserts > 1 at the first update", 1,
            low_open=True),
    VerlKey(f"{A}.entropy_coeff", float, "the entropy bonus' weight in the policy loss"),
    VerlKey(f"{A}.kl_loss_coef", float, "the KL loss' weight against the reference (GRPO's use_kl_loss)", 0),
    VerlKey(f"{A}.ppo_epochs", int, "passes of the actor's update over each batch", 1),
    VerlKey(f"{A}.ppo_mini_batch_size", int, "prompts per optimizer step (verl multiplies it by rollout.n)", 1),
    # The algorithm (verl's ray_trainer: compute_advantage, apply_kl_penalty).
    VerlKey("algorithm.kl_ctrl.kl_coef", float, "the in-reward KL penalty's coefficient (use_kl_in_reward)", 0),
    # The rollout's sampling (vLLM's SamplingParams and CacheConfig, from verl's vLLMRollout).
    VerlKey(f"{R}.temperature", float, "vLLM's sampling temperature: 0 is greedy, so every response of a GRPO group "
                                       "is the same and every advantage 0; vLLM refuses a negative one at the first "
                                       "generate", 0, low_open=True),
    VerlKey(f"{R}.top_p", float, "vLLM's nucleus sampling; vLLM refuses a value outside (0, 1]", 0, 1,
            low_open=True),
    VerlKey(f"{R}.top_k", int, "vLLM's top-k; -1 or 0: off; vLLM refuses below -1", -1),
    VerlKey(f"{R}.gpu_memory_utilization", float, "the device memory share vLLM's cache engine sizes itself to; "
                                                  "vLLM refuses above 1", 0, 1, low_open=True),
    VerlKey(f"{R}.n", int, "responses sampled per prompt: GRPO's group", 1),
    VerlKey(f"{R}.prompt_length", int, "the rollout's prompt length (verl's YAML: data.max_prompt_length)", 1),
    VerlKey(f"{R}.response_length", int, "vLLM's max_tokens (verl's YAML: data.max_response_length)", 1),
    # The data (verl's RLHFDataset and the trainer's dataloader).
    VerlKey("data.train_batch_size", int, "prompts per training step", 1),
    VerlKey("data.max_prompt_length", int, "prompts are padded or cut to it", 1),
    VerlKey("data.max_response_length", int, "the longest response sampled", 1),
    # The trainer's schedule (verl's RayPPOTrainer.fit).
    VerlKey("trainer.total_epochs", int, "passes over the data; with total_training_steps unset, the steps", 1),
    VerlKey("trainer.total_training_steps", int, "the steps to train (null: epochs x batches)", 1, nullable=True),
    VerlKey("trainer.save_freq", int, "save every N steps and at the last; -1 or 0: never", -1),
    VerlKey("trainer.test_freq", int, "validate every N steps and at the last; -1 or 0: never", -1),
)
BY_PATH: dict[str, VerlKey] = {k.path: k for k in KEYS}


@dataclass(frozen=True)
class Relation:
    """A rule between keys: ``check`` takes their values (each already well-typed by its own rule) and says
    what is wrong, or None. ``breaking``: values of the keys that break it (the tests apply them)."""

    name: str
    keys: tuple[str, ...]
    doc: str
    check: Callable[[Mapping[str, Any]], Optional[str]]
    breaking: Mapping[str, Any]


def _grpo_group(v: Mapping[str, Any]) -> Optional[str]:
    n = v[f"{R}.n"]
    if v["algorithm.adv_estimator"] == "grpo" and n < 2:
        return (f"{R}.n={n} with algorithm.adv_estimator=grpo: GRPO normalises each reward within its prompt's group "
                "of n responses, and verl gives a group of one mean 0 and std 1, so the advantage is the raw reward "
                "with no baseline; sample at least 2 responses per prompt")
    return None


def _lr_order(low_key: str, what: str) -> Callable[[Mapping[str, Any]], Optional[str]]:
    def check(v: Mapping[str, Any]) -> Optional[str]:
        lr, low = v[f"{OPTIM}.lr"], v[low_key]
        if low is not None and low > lr:
            return f"{low_key}={low} is above {OPTIM}.lr={lr}: megatron-core's scheduler asserts {what} <= max_lr"
        return None
    return check


RELATIONS: tuple[Relation, ...] = (
    Relation("grpo_group", ("algorithm.adv_estimator", f"{R}.n"), "GRPO needs a group of at least two responses",
             _grpo_group, {"algorithm.adv_estimator": "grpo", f"{R}.n": 1}),
    Relation("min_lr", (f"{OPTIM}.lr", f"{OPTIM}.min_lr"), "the learning-rate floor is not above the peak",
             _lr_order(f"{OPTIM}.min_lr", "min_lr"), {f"{OPTIM}.lr": 1e-6, f"{OPTIM}.min_lr": 1e-5}),
    Relation("lr_warmup_init", (f"{OPTIM}.lr", f"{OPTIM}.lr_warmup_init"), "warmup starts at or below the peak",
             _lr_order(f"{OPTIM}.lr_warmup_init", "init_lr"), {f"{OPTIM}.lr": 1e-6, f"{OPTIM}.lr_warmup_init": 1e-5}),
)


def problems(select: Callable[[str], Any]) -> tuple[list[str], set[str]]:
    """Every bad value of the declared keys in the config that ``select`` (dotted path -> resolved value) reads,
    then every broken relation among keys that are themselves well-formed: (the messages, the keys named)."""
    out: list[str] = []
    bad: set[str] = set()
    values: dict[str, Any] = {}
    for key in KEYS:
        value = select(key.path)
        values[key.path] = value
        found = key.problem(value)
        if found:
            out.append(found)
            bad.add(key.path)
    for rel in RELATIONS:
        if any(k in bad for k in rel.keys):
            continue
        found = rel.check({k: values[k] if k in values else select(k) for k in rel.keys})
        if found:
            out.append(found)
            bad.update(rel.keys)
    return out, bad
