"""Each recipe setting declared once (verl_patches/config/settings.py, issue 49): the tables are the groups'
fields, each declared default is what the shipped run configs mean (or a listed reason and a comment say why
not), and the reshard bucket's default and bounds reach every tool and caller from that one declaration."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import yaml

from tests.helpers import REPO
from verl_patches.config import settings
from verl_patches.config.megatron_args import RecipeMegatron
from verl_patches.preflight.cli import build_parser as preflight_parser
from verl_patches.preflight.switch_rehearsal import Options
from verl_patches.reshard.cli import main as plan_main
from verl_patches.reshard.planner import build_plan
from verl_patches.reshard.weight_sync import WeightSync, execute
from verl_patches.rollout.dp_domain import DPSpec
from verl_patches.rollout.long_tail.rebalance import RebalancePolicy
from verl_patches.train.ddp_overlap import DdpOverlap

SECTIONS = ("vllm_dp", "profile", "megatron")


def test_the_tables_are_the_groups_fields_flat_on_recipe_settings():
    grouped = [f.name for g in settings.GROUPS for f in dataclasses.fields(g)]
    assert list(settings.KEYS) == grouped + list(SECTIONS)
    run = settings.RecipeSettings()
    assert all(getattr(run, k) == settings.KEYS[k].default for k in grouped)
    assert [f.name for f in dataclasses.fields(settings.VllmDpSettings)] == list(settings.VLLM_DP)
    assert [f.name for f in dataclasses.fields(settings.ProfileSettings)] == list(settings.PROFILE)
    assert settings.build({}) == run and run.vllm_dp == settings.VllmDpSettings()
    assert all(settings.KEYS[s].kind == "section" and settings.KEYS[s].default is None for s in SECTIONS)


def test_a_field_whose_annotation_contradicts_its_rules_is_refused():
    @dataclass(frozen=True)
    class NullWithoutOptional:
        x: int = settings.setting(None, "a null default needs Optional")

    @dataclass(frozen=True)
    class ChoicesOfAnInt:
        x: int = settings.setting(1, "choices are for strings", choices=("1", "2"))

    @dataclass(frozen=True)
    class Fine:
        x: Optional[float] = settings.setting(None, "ok", minimum=1.0)
        y: str = settings.setting("a", "ok", choices=("a", "b"))

    for bad in (NullWithoutOptional, ChoicesOfAnInt):
        with pytest.raises(TypeError, match="recipe key x"):
            settings._table(bad)
    table = settings._table(Fine)
    assert table["x"] == settings.Key(float, None, "ok", 1.0) and table["y"].kind == ("a", "b")


def test_the_readers_own_objects_default_as_the_declarations():
    """The readers' own dataclasses and defaults, built without a recipe section, mean the declared defaults."""
    keys = settings.KEYS
    assert DdpOverlap() == DdpOverlap(keys["overlap_grad_reduce"].default, keys["overlap_param_gather"].default)
    assert RebalancePolicy() == RebalancePolicy(keys["rebalance"].default,
                                                keys["rebalance_min_graph_size_drop"].default,
                                                keys["rebalance_max_imbalance"].default)
    vllm_dp = settings.VllmDpSettings()
    spec = DPSpec(tp_size=1, dp_size=1)
    assert (spec.instances, spec.master_port_base, spec.port_stride) == (vllm_dp.instances, vllm_dp.master_port_base,
                                                                         vllm_dp.port_stride)
    assert inspect.signature(execute).parameters["method"].default == keys["reshard_method"].default


# --- each declared default is what the shipped configs mean ---

CONFIGS = REPO / "configs"
# Keys whose shipped values differ from the declared default (or among the configs), each with its reason; the
# field's declaration in verl_patches/config/settings.py carries the same reason as a comment.
DIFFERS = {
    "reshard_bucket_mb": "the NVIDIA configs' 512 is measured on H200; the default is the Ascend configs' 256",
    "fixed_routing": "True in the random-init benchmarks only; a real model's routing otherwise",
    "overlap_grad_reduce": "the default stays verl's DDP, for a verl config without the distributed optimizer",
    "overlap_param_gather": "the default stays verl's DDP, for a verl config without the distributed optimizer",
    "device_memory_gib": "the machine's memory: no default fits every machine",
    "host_memory_gib": "the machine's memory: no default fits every machine",
    "vllm_dp.dp_size": "the layout's: each run config sets its own",
    "vllm_dp.instances": "the layout's: each run config sets its own",
    "profile.dir": "an interpolation of the trainer's config (the run's checkpoint directory)",
    "megatron": "MindSpeed's switches: off without MindSpeed, on in the Ascend configs; the layers are the layout's",
}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _recipe(name: str) -> dict:
    """The recipe section a config composes to from configs/ alone (its defaults list in order; verl's own
    files, not under configs/, have no recipe section)."""
    path = CONFIGS / f"{name}.yaml"
    if not path.exists():
        return {}
    raw = yaml.safe_load(path.read_text()) or {}
    own = ((raw.get("actor_rollout_ref") or {}).get("rollout") or {}).get("recipe") or {}
    out: dict = {}
    for entry in raw.get("defaults") or ["_self_"]:
        out = _merge(out, own if entry == "_self_" else _recipe(entry))
    return out


def _same(value: Any, default: Any) -> bool:
    return list(value) == list(default) if isinstance(value, list) and isinstance(default, tuple) else value == default


def _differences() -> dict[str, set[str]]:
    """key -> the configs that set it to something other than its declared default ('???' is a value the run
    config must set: not a value)."""
    found: dict[str, set[str]] = {}
    megatron = {f.name: f.default for f in dataclasses.fields(RecipeMegatron)}
    for path in sorted(CONFIGS.glob("*.yaml")):
        recipe = _recipe(path.stem)
        for name, value in recipe.items():
            if name in SECTIONS:
                table = {"vllm_dp": {k: v.default for k, v in settings.VLLM_DP.items()},
                         "profile": {k: v.default for k, v in settings.PROFILE.items()}, "megatron": megatron}[name]
                for sub, v in (value or {}).items():
                    if v != "???" and not _same(v, table[sub]):
                        found.setdefault("megatron" if name == "megatron" else f"{name}.{sub}", set()).add(path.stem)
            elif value != "???" and not _same(value, settings.KEYS[name].default):
                found.setdefault(name, set()).add(path.stem)
    return found


def test_each_default_is_what_the_shipped_configs_mean_or_says_why_not():
    found = _differences()
    assert set(found) - set(DIFFERS) == set(), {k: sorted(found[k]) for k in set(found) - set(DIFFERS)}
    # A listed key whose configs came to agree with its default: drop it from DIFFERS (and its comment).
    assert set(DIFFERS) - set(found) == set()


def test_every_listed_difference_has_its_comment_at_the_declaration():
    lines = (REPO / "verl_patches" / "config" / "settings.py").read_text().splitlines()
    missing = []
    for key in DIFFERS:
        name = key.rsplit(".", 1)[-1]
        at = [i for i, line in enumerate(lines) if line.startswith(f"    {name}: ") and "= s" in line]
        if len(at) != 1 or not lines[at[0] - 1].strip().startswith("#"):
            missing.append(key)
    assert missing == []


def test_fingerprint_every_defaults_to_what_every_config_sets():
    assert settings.KEYS["fingerprint_every"].default == 1
    # Every config that composes a whole recipe section (not a fragment such as the H100 one) sets 1.
    whole = [_recipe(p.stem) for p in CONFIGS.glob("*.yaml") if "reshard_method" in _recipe(p.stem)]
    assert len(whole) >= 9 and {r["fingerprint_every"] for r in whole} == {1}


# --- the reshard bucket: one default, one set of tool bounds ---

def test_every_tool_and_caller_takes_the_declared_bucket(capsys):
    assert settings.BUCKET_MB == settings.KEYS["reshard_bucket_mb"].default \
        == settings.RecipeSettings().reshard_bucket_mb
    assert settings.BUCKET_BYTES == settings.BUCKET_MB << 20
    assert preflight_parser().get_default("bucket_mb") == settings.BUCKET_MB
    assert Options.__dataclass_fields__["bucket_mb"].default == settings.BUCKET_MB
    for fn in (build_plan, WeightSync.build):
        assert inspect.signature(fn).parameters["bucket_bytes"].default == settings.BUCKET_BYTES, fn
    assert plan_main(["--model", str(CONFIGS / "model" / "tiny_deepseek_v3.json"), "--train", "tp=1",
                      "--rollout", "dp=1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bucket_bytes"] == settings.BUCKET_BYTES
    # The tools' bounds hold the run's whole range.
    key = settings.KEYS["reshard_bucket_mb"]
    assert settings.TOOL_BUCKET_MB_LOW <= key.minimum and key.maximum <= settings.TOOL_BUCKET_MB_HIGH


BUCKET_NAMES = ("bucket_mb", "bucket_bytes")
# A bucket written out on purpose, with its reason.
OWN_BUCKETS = {
    ("verl_patches/rigs/testing/selfcheck.py", "bucket_bytes"): "4 KiB, to split the rig's tiny models into many buckets",
}


def _written_out(node: Optional[ast.AST]) -> bool:
    """A number written out (a literal or arithmetic of literals), not a name."""
    arithmetic = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)
    return node is not None and not (isinstance(node, ast.Constant) and node.value is None) \
        and all(isinstance(n, arithmetic) for n in ast.walk(node))


def _bucket_literals(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults)) \
                + list(zip(a.kwonlyargs, a.kw_defaults))
            out += [(d.lineno, arg.arg) for arg, d in pairs if arg.arg in BUCKET_NAMES and _written_out(d)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id in BUCKET_NAMES and _written_out(node.value):
            out.append((node.lineno, node.target.id))
        elif isinstance(node, ast.keyword) and node.arg in BUCKET_NAMES and _written_out(node.value):
            out.append((node.value.lineno, node.arg))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument" \
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--bucket-mb":
            kw = {k.arg: k.value for k in node.keywords}
            bounds = [k.value for k in getattr(kw.get("type"), "keywords", []) if k.arg in ("low", "high")]
            if _written_out(kw.get("default")) or any(_written_out(b) for b in bounds) or len(bounds) != 2:
                out.append((node.lineno, "--bucket-mb"))
    return out


def test_no_second_bucket_default_or_bound_is_written_out():
    """Outside verl_patches/config/settings.py no module or script writes a bucket size as a default, a caller's
    value or a --bucket-mb bound: each takes BUCKET_MB / BUCKET_BYTES / TOOL_BUCKET_MB_* (tests may)."""
    offenders = []
    for path in sorted([*(REPO / "verl_patches").rglob("*.py"), *(REPO / "scripts").glob("*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel == "verl_patches/config/settings.py":
            continue
        for line, name in _bucket_literals(ast.parse(path.read_text())):
            if (rel, name) not in OWN_BUCKETS:
                offenders.append(f"{rel}:{line} {name}")
    assert offenders == []


@pytest.mark.parametrize("source,found", [
    ("def build_plan(m, bucket_bytes: int = 256 << 20): pass", [(1, "bucket_bytes")]),
    ("class O:\n    bucket_mb: float = 64.0", [(2, "bucket_mb")]),
    ("build_plan(m, bucket_bytes=1 << 28)", [(1, "bucket_bytes")]),
    ("ap.add_argument('--bucket-mb', type=Number(low=0, low_open=True), default=256.0)", [(1, "--bucket-mb")]),
    ("ap.add_argument('--bucket-mb', type=Number(low=LOW, high=HIGH), default=float(BUCKET_MB))", []),
    ("def f(bucket_bytes: int = BUCKET_BYTES, bucket_mb=None): build_plan(bucket_bytes=n << 20)", []),
])
def test_the_scan_finds_a_written_out_bucket(source, found):
    assert _bucket_literals(ast.parse(source)) == found
