"""Which patch records apply on the NPU rehearsal platform (verl_patches/rigs/npu_rehearsal/records.py), read from the
real catalogue: every host-only record and every vLLM-Ascend record is decided, the NPU's model records apply, the
host Transformer Engine spec never does."""

from __future__ import annotations

import pytest

from verl_patches.rigs.npu_rehearsal import records
from verl_patches.patches import load_catalogue


def test_every_host_only_and_vllm_ascend_record_is_decided_and_the_tables_name_only_real_records():
    catalogue = load_catalogue()
    ids = {p.id for p in catalogue}
    for p in catalogue:
        records.applies_on_rehearsal(p)  # raises for an undecided one
    assert set(records.APPLY) | set(records.SKIP) | set(records.NPU_SKIP) <= ids
    assert not set(records.APPLY) & set(records.SKIP)


def test_the_npu_model_applies_and_the_host_layer_spec_does_not():
    by_id = {p.id: p for p in load_catalogue()}
    on = {i for i, p in by_id.items() if records.applies_on_rehearsal(p)}
    assert {"verl.deepseek_v3_mindspeed_llm_layer_spec", "mindspeed.no_megatron_text_generation",
            "mindspeed.recipe_megatron_args", "cpu.vllm.llm_generate", "cpu.megatron.moe_host_split_sizes"} <= on
    assert not {"cpu.verl.deepseek_v3_host_layer_spec", "cpu.torch.cuda_current_device", "cpu.verl.dist_backend",
                "vllm_ascend.worker.stable_regions"} & on


def test_an_undecided_host_record_fails_naming_the_table():
    from verl_patches.core.fingerprint import Fingerprint
    from verl_patches.core.record import Patch

    new = Patch(feature="cpu_platform", id="cpu.torch.new_thing", target="torch.cuda:is_available", kind="replace",
                phases=("worker",), upstream="torch", versions=">=2", fingerprint=Fingerprint("def is_available()", "0"),
                replacement="verl_patches.rigs.npu_rehearsal.records:applies", flag="", why="x", remove_when="x",
                platforms=("cpu",))
    with pytest.raises(KeyError, match="APPLY or SKIP in verl_patches/rigs/npu_rehearsal/records.py"):
        records.applies_on_rehearsal(new)
