"""docs/RECIPE.md "Hyperparameter parity", row by row, against what the recipe really runs with.

Each row names where our value lives and states it for both runs; this test computes that value the way
the run does and compares, and checks the verdict: "equal" rows must equal the reference's value in
both runs, "differs:" rows must give a reason. Places:
- ``cfg:PATH``: the run config composed with the installed verl 0.4.1 (Hydra, resolved);
- ``ms:NAME``: the MindSpeed argument the worker binding hands over (megatron_args.mindspeed_args);
- ``tf:FIELD``: megatron-core's TransformerConfig exactly as verl 0.4.1's converter builds it for the
  model in configs/model/deepseek_v3.json, with the run's override_transformer_config, the recipe's own
  overrides and the DeepSeek-V3 routing patch (real parallel state: one gloo rank, in this process);
- ``optim:FIELD``: megatron-core's OptimizerConfig from verl's init_megatron_optim_config with the
  Adam-betas patch applied.
- ``ddp:FIELD``: megatron-core's DistributedDataParallelConfig as patch verl.ddp_overlap.get_model builds it
  for the actor (verl_patches/train/ddp_overlap.py: the recipe's overlap keys, actor.megatron.use_distributed_optimizer,
  one model chunk per virtual pipeline stage);
- ``calc:rollout_ep``: the rollout's expert parallel per engine instance, vLLM DP size x rollout TP;
- ``lock:NAME``: whether configs/upstream.lock.toml lists component NAME (so the image installs it);
- ``data:train_fraction`` / ``data:shuffled`` / ``data:instruction``: what verl_patches/data/prepare.py
  does with its defaults, run on rows of our own: the share of rows in the training split, whether
  the split is drawn out of file order, and whether the prompt is more than the problem.
Verdicts: ``equal`` (optionally ``equal; <note>`` where the reference's own sources disagree with each
other or with what this project was first told), or ``differs: <reason>``.
Nothing is skipped: a row whose place this test does not know fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from verl_patches.config import megatron_args as ma
from verl_patches.checks import recipe_config as RC

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "RECIPE.md"
RUNS = ("random_init", "true_weight")
CKPT = ["actor_rollout_ref.actor.megatron.dist_checkpointing_path=/ckpt/dsv3"]
NONE = "—"


def parity_rows() -> list[dict]:
    text = DOC.read_text()
    section = text.split("## Hyperparameter parity", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 8 or not cells[0].isdigit():
            continue
        rows.append(dict(n=int(cells[0]), setting=cells[1], ref=dict(zip(RUNS, cells[2:4])), where=cells[4].strip("`"),
                         ours=dict(zip(RUNS, cells[5:7])), verdict=cells[7]))
    return rows


def value(cell: str):
    cell = cell.strip()
    if cell == NONE:
        return NONE
    return yaml.safe_load(cell.strip("`"))


@pytest.fixture(scope="module")
def configs():
    return {"random_init": RC.compose("deepseekv3_256die_random_init"),
            "true_weight": RC.compose("deepseekv3_256die_true_weight", CKPT)}


@pytest.fixture(scope="module")
def transformer_configs(configs):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from transformers import AutoConfig

    from verl_patches.core import apply as ap
    from verl_patches.patches.verl.patch_models_mcore_registry import PATCHES

    # The config records only (the module also holds the update's entropy record, which needs the actor's).
    ROUTING = [p for p in PATCHES if p.target.endswith(":hf_to_mcore_config")]
    from verl_patches.launch.local_ranks import free_port

    hf = AutoConfig.for_model(**RC.load_model_config(RC.DEFAULT_MODEL_CONFIG))
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        mpu.initialize_model_parallel()
    ap.apply_all(ROUTING)
    try:
        from verl.models.mcore import hf_to_mcore_config

        out = {}
        for run, cfg in configs.items():
            recipe = ma.parse(OmegaConf.to_container(cfg.actor_rollout_ref.rollout.recipe.megatron, resolve=True))
            user = OmegaConf.to_container(cfg.actor_rollout_ref.actor.megatron.override_transformer_config, resolve=True)
            out[run] = hf_to_mcore_config(hf, torch.bfloat16, **ma.merge_overrides(user, ma.transformer_config_overrides(recipe)))
        return out
    finally:
        ap.undo([p.id for p in ROUTING])
        if ours:
            mpu.destroy_model_parallel()
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def optimizer_configs(configs):
    from verl_patches.core import apply as ap
    from verl_patches.patches.verl.patch_utils_megatron_utils import PATCHES

    betas = [p for p in PATCHES if p.id == "verl.optim.adam_betas"]
    ap.apply_all(betas)
    try:
        from verl.utils import megatron_utils

        return {run: megatron_utils.init_megatron_optim_config(OmegaConf.to_container(cfg.actor_rollout_ref.actor.optim,
                                                                                      resolve=True))
                for run, cfg in configs.items()}
    finally:
        ap.undo([p.id for p in betas])


def ours(row, run, configs, transformer_configs, optimizer_configs):
    kind, _, name = row["where"].partition(":")
    cfg = configs[run]
    if kind == "cfg":
        v = OmegaConf.select(cfg, name, default=None)
        return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
    if kind == "ms":
        section = OmegaConf.to_container(cfg.actor_rollout_ref.rollout.recipe.megatron, resolve=True)
        return ma.mindspeed_args(ma.parse(section)).get(name)
    if kind == "tf":
        return getattr(transformer_configs[run], name)
    if kind == "optim":
        return getattr(optimizer_configs[run], name)
    if kind == "ddp":
        from megatron.core.distributed import DistributedDataParallelConfig

        from verl_patches.train.ddp_overlap import DdpOverlap, ddp_config_values

        megatron = cfg.actor_rollout_ref.actor.megatron
        values = ddp_config_values(DdpOverlap.from_trainer(cfg), use_distributed_optimizer=megatron.use_distributed_optimizer,
                                   num_chunks=megatron.get("virtual_pipeline_model_parallel_size") or 1)
        return getattr(DistributedDataParallelConfig(**values), name)
    if kind == "calc" and name == "rollout_ep":
        rollout = cfg.actor_rollout_ref.rollout
        return int(rollout.recipe.vllm_dp.dp_size) * int(rollout.tensor_model_parallel_size)
    if kind == "lock":
        from verl_patches.core.lock import load_lock

        return name in load_lock()
    if kind == "data":
        return data_fact(name)
    raise AssertionError(f"row {row['n']}: unknown place {row['where']!r}")


def data_fact(name: str):
    """What verl_patches/data/prepare.py does with its defaults (the ones scripts and docs use)."""
    import inspect

    from verl_patches.data import prepare as P

    defaults = inspect.signature(P.prepare).parameters
    rows = [P.Example(f"problem {i}", str(i), "", i + 1, "deepscaler") for i in range(1000)]
    train, test = P.split_examples(rows, defaults["test_size"].default, defaults["seed"].default)
    if name == "train_fraction":
        return len(train) / len(rows)
    if name == "shuffled":
        return [ex.row for ex in train] != [ex.row for ex in rows[:len(train)]]
    if name == "instruction":
        record = P.to_record(rows[0], "train", 0, "deepscaler")
        return record["prompt"][0]["content"] != rows[0].question
    raise AssertionError(f"unknown data fact {name!r}")


def test_the_table_is_there_and_numbered():
    rows = parity_rows()
    assert len(rows) >= 60
    assert [r["n"] for r in rows] == list(range(1, len(rows) + 1))


@pytest.mark.parametrize("row", parity_rows(), ids=lambda r: f"{r['n']}-{r['setting'][:40]}")
def test_each_row(row, configs, transformer_configs, optimizer_configs):
    verdict = row["verdict"]
    assert re.fullmatch(r"equal(; \S.*)?", verdict) or re.match(r"differs: \S", verdict), \
        f"row {row['n']}: verdict {verdict!r}"
    for run in RUNS:
        want = value(row["ours"][run])
        if row["where"] == NONE:
            assert want == NONE and verdict.startswith("differs"), f"row {row['n']}: no place needs '—' and a reason"
            continue
        got = ours(row, run, configs, transformer_configs, optimizer_configs)
        assert got == want, f"row {row['n']} ({row['setting']}, {run}): ours is {got!r}, the table says {want!r}"
        if verdict.startswith("equal"):
            assert want == value(row["ref"][run]), f"row {row['n']}: 'equal' but {want!r} vs reference {row['ref'][run]!r}"
    if verdict.startswith("differs"):
        assert any(value(row["ours"][r]) != value(row["ref"][r]) for r in RUNS), \
            f"row {row['n']}: marked 'differs' but equal in both runs"


def test_the_ascend_scheduler_of_vllm_ascend_0_9_1_refuses_the_references_unchunked_prefill():
    # Row "ascend_scheduler_config.enable_chunked_prefill": the reason it differs, shown on the real class.
    from types import SimpleNamespace

    from vllm.config import SchedulerConfig
    from vllm_ascend.core.schedule_config import AscendSchedulerConfig

    base = SchedulerConfig(max_num_batched_tokens=1024, max_model_len=1024 + 3072, enable_chunked_prefill=True,
                           max_num_seqs=64)
    with pytest.raises(ValueError, match="without chunked prefill"):
        AscendSchedulerConfig.initialize_from_config(base, SimpleNamespace(enabled=True, enable_chunked_prefill=False))
    ok = AscendSchedulerConfig.initialize_from_config(base, SimpleNamespace(enabled=True, enable_chunked_prefill=True))
    assert ok.chunked_prefill_enabled


def test_the_adam_betas_patch_keeps_upstreams_defaults_when_the_yaml_has_none():
    from verl_patches.core import apply as ap
    from verl_patches.patches.verl.patch_utils_megatron_utils import PATCHES

    betas = [p for p in PATCHES if p.id == "verl.optim.adam_betas"]
    from verl.utils import megatron_utils

    upstream = megatron_utils.init_megatron_optim_config({"lr": 1e-6})
    ap.apply_all(betas)
    try:
        plain = megatron_utils.init_megatron_optim_config({"lr": 1e-6})
        assert (plain.adam_beta1, plain.adam_beta2, plain.adam_eps) == (upstream.adam_beta1, upstream.adam_beta2,
                                                                         upstream.adam_eps)
        set_ = megatron_utils.init_megatron_optim_config({"lr": 1e-6, "adam_beta2": 0.95, "adam_eps": 1e-8})
        assert set_.adam_beta2 == 0.95 and set_.adam_eps == 1e-8 and upstream.adam_beta2 == 0.999
        with pytest.raises(ValueError, match="adam_beta2 must be a number"):
            megatron_utils.init_megatron_optim_config({"lr": 1e-6, "adam_beta2": "0.95"})
    finally:
        ap.undo([p.id for p in betas])


def test_the_steps_per_epoch_in_row_103_follow_from_the_split():
    # One epoch of the reference: deepscaler's 40,315 problems, 90% to training, batches of 512 with
    # verl 0.4.1's drop_last. Our split of the same file gives the same count (row 117).
    from verl_patches.data import prepare as P

    n_problems, batch = 40315, 512
    reference_train = int(n_problems * 0.9)  # its json_to_parquet.py: int(len * ratio)
    ours, _ = P.split_examples([P.Example("q", "a", "", i + 1) for i in range(n_problems)], 0.1, 0)
    assert (reference_train, len(ours)) == (36283, 36283)
    row = next(r for r in parity_rows() if r["n"] == 103)
    steps = reference_train // batch
    assert f"{reference_train:,} prompts, so {steps} full steps of {batch}" in row["verdict"], row["verdict"]
    assert "78" not in row["verdict"]


def test_the_pinned_vllm_ascend_still_writes_the_decode_cache_in_the_layout_the_references_nz_fix_corrects():
    # Row 97's reason, read in the installed vLLM-Ascend 0.9.1 source (it imports torch_npu, so it is
    # read, not imported): the decode path's cache_mode is PA_BLK_NZ while the prefill path uses PA_NZ.
    import importlib.util

    spec = importlib.util.find_spec("vllm_ascend")
    source = (Path(spec.submodule_search_locations[0]) / "attention" / "mla_v1.py").read_text()
    assert 'cache_mode = "PA_BLK_NZ" if self.enable_kv_nz else "PA"' in source
    assert 'cache_mode = "PA_NZ" if self.enable_kv_nz else "PA"' in source


def test_mindspeed_stands_in_for_the_apex_names_megatron_core_needs():
    # Row 116's reason: MindSpeed 2.2.0 registers its own objects under apex's names, so no apex package
    # is needed on NPU; read in the installed source (importing MindSpeed's features needs torch_npu).
    import importlib.util

    assert importlib.util.find_spec("apex") is None, "apex is installed here; row 116 says it is not"
    spec = importlib.util.find_spec("mindspeed")
    if spec is None:
        pytest.skip("MindSpeed not installed (scripts/install_upstream_sources.sh found no archive): its apex "
                    "registrations cannot be read here")
    source = (Path(spec.submodule_search_locations[0]) / "features_manager" / "megatron_basic" /
              "requirements_basic.py").read_text()
    for name in ("apex.optimizers.FusedAdam", "apex.normalization.fused_layer_norm.FusedLayerNormAffineFunction",
                 "apex.multi_tensor_apply.multi_tensor_applier"):
        assert f"'{name}'" in source, name
    # No longer registered from 2.2.0; megatron-core imports it under try/except (fusions/fused_layer_norm.py).
    assert "'apex.contrib.layer_norm.layer_norm.FastLayerNormFN'" not in source
    assert importlib.util.find_spec("apex") is None, "apex is installed here; row 116 says it is not"


def test_recipe_names_the_reference_repository_release_and_commit():
    text = DOC.read_text()
    section = text.split("## The reference: repository, release and commit", 1)[1].split("\n## ", 1)[0]
    assert "cann-recipes-train" in section and "llm_rl/deepseek" in section
    assert "`v0.1.0`" in section
    assert re.search(r"`[0-9a-f]{40}`", section), "no full commit hash named"
