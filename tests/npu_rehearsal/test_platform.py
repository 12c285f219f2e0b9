"""The NPU rehearsal platform (verl_patches/rigs/npu_rehearsal): selection, refusal beside a real torch_npu, the
stand-in's device mapping and loud failures, and the NPU path it exists for (tests/npu_rehearsal/npu_path_build.py).

Activation renames torch's PrivateUse1 backend and MindSpeed patches megatron-core in place, so everything that
activates runs in its own process. The NPU-path test needs MindSpeed-LLM, Megatron-LM's training
package and MindSpeed >= v2.2.0_core_r0.12.1 importable; it is skipped, saying which is missing, otherwise.
"""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import needs_npu_stack
from verl_patches.rigs import npu_rehearsal

REPO = Path(__file__).resolve().parents[2]


def run(code_or_file: str, *argv: str, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    # As the launcher runs a rehearsal process: the stand-in's site on PYTHONPATH, one rank, vLLM's plugins ours.
    path = os.pathsep.join(x for x in (str(REPO), str(npu_rehearsal.SITE), os.environ.get("PYTHONPATH")) if x)
    environ = {**os.environ, "VERL_PATCHES_PLATFORM": "npu-rehearsal", "PYTHONPATH": path, "WORLD_SIZE": "1",
               "RANK": "0", "VLLM_PLUGINS": "verl_patches", **env}
    args = [sys.executable, code_or_file] if code_or_file.endswith(".py") else [sys.executable, "-c", code_or_file]
    args += list(argv)
    return subprocess.run(args, env=environ, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_the_stand_in_is_used_only_when_selected(monkeypatch):
    monkeypatch.delenv("VERL_PATCHES_PLATFORM", raising=False)
    with pytest.raises(npu_rehearsal.RehearsalError, match="VERL_PATCHES_PLATFORM=npu-rehearsal"):
        npu_rehearsal.activate()
    assert "torch_npu" not in sys.modules
    assert "not selected" in npu_rehearsal.describe()


def test_a_real_torch_npu_refuses_the_stand_in_naming_both(monkeypatch, tmp_path):
    # A fake, declared as such: an empty package named torch_npu stands for a real installation (never imported).
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("raise AssertionError('fake real torch_npu imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VERL_PATCHES_PLATFORM", "npu-rehearsal")
    with pytest.raises(npu_rehearsal.RehearsalError) as e:
        npu_rehearsal.activate()
    assert str(tmp_path / "torch_npu") in str(e.value) and str(npu_rehearsal.SITE / "torch_npu") in str(e.value)
    assert "real" in npu_rehearsal.describe()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_forced_host_device_contradicts_the_rehearsal_naming_both(monkeypatch, device):
    # Forced to another device, the overlay would take that device's records under the rehearsal's name.
    monkeypatch.setenv("VERL_PATCHES_PLATFORM", "npu-rehearsal")
    monkeypatch.setenv("VERL_PATCHES_DEVICE", device)
    with pytest.raises(npu_rehearsal.RehearsalError, match=f"VERL_PATCHES_DEVICE={device} contradicts "
                                                           "VERL_PATCHES_PLATFORM=npu-rehearsal"):
        npu_rehearsal.activate()
    assert "torch_npu" not in sys.modules


DEVICE_API = """
import json, tempfile, torch, torch.distributed as dist
from verl_patches.rigs import npu_rehearsal
npu_rehearsal.activate()
from torch_npu.contrib import transfer_to_npu
out = {"describe": npu_rehearsal.describe(), "npu_is_stand_in": torch.npu.__name__ == "torch_npu.npu"}
out["cuda_device"] = str(torch.zeros(2, device="cuda").device)
out["index_device"] = str(torch.empty(2, device=torch.cuda.current_device()).device)
out["to_npu"] = str(torch.ones(1).to("npu:0").device)
s = torch.npu.Stream(); e = torch.cuda.Event(enable_timing=True); e.record(s); s.wait_event(e)
with torch.npu.stream(s):
    pass
dist.init_process_group("hccl", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
out["backend"] = dist.get_backend()
# Pinned host memory (torch asks the NPU's hooks once PrivateUse1 is renamed: answered on the host).
host = torch.arange(6.0)
pinned = host.pin_memory()
made = torch.empty(4, pin_memory=True)
out["pinned"] = [host.is_pinned(), pinned.is_pinned(), pinned[2:].is_pinned(), pinned.pin_memory() is pinned,
                 torch.equal(pinned, host), made.is_pinned(), torch.zeros(2).is_pinned(),
                 torch.empty_like(host, pin_memory=True).is_pinned()]
# Tensor.type(): a device tensor answers torch_npu's name (MindSpeed's adaptor turns npu into cuda for megatron's
# optimizers); pinned host memory stays the host's; a conversion is torch's own.
from verl_patches.base import accelerator
w = torch.zeros(2, dtype=torch.bfloat16, device="npu:0")
out["types"] = [w.type(), torch.nn.Parameter(w).type(), made.type(), w.type(torch.float32).type(),
                str(w.type(torch.float32).dtype), accelerator.tensor_device_type()]
for name in ("torch.npu.not_an_api", "torch_npu.npu_not_an_operator"):
    try:
        eval(name, {"torch": torch, "torch_npu": __import__("torch_npu")})
        out[name] = "no error"
    except AttributeError as err:
        out[name] = str(err)
try:
    from mindspeed.op_builder import GMMOpBuilder
except ImportError:
    out["builder"] = "mindspeed not installed"
else:
    from verl_patches.rigs.npu_rehearsal import ops
    npu_rehearsal.activate_mindspeed_kernels()
    builder = GMMOpBuilder()  # one instance: its constructor defines the torch-library schema
    out["builder_known"] = sorted(vars(builder.load()))
    del ops.MINDSPEED_KERNELS["grouped_matmul"]
    GMMOpBuilder._loaded_ops.clear()
    try:
        builder.load()
        out["builder"] = "no error"
    except Exception as err:
        out["builder"] = f"{type(err).__name__}: {err}"
print("RESULT " + json.dumps(out))
"""


def result(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_the_stand_in_maps_the_device_api_onto_the_host_and_fails_loudly():
    out = result(run(DEVICE_API))
    assert out["describe"].startswith("torch_npu: STAND-IN of the NPU rehearsal platform")
    assert out["npu_is_stand_in"]
    assert out["cuda_device"] == out["index_device"] == out["to_npu"] == "cpu"
    assert out["backend"] == "gloo"
    assert out["pinned"] == [False, True, True, True, True, True, False, True]
    assert out["types"] == ["torch.npu.BFloat16Tensor", "torch.npu.BFloat16Tensor", "torch.FloatTensor",
                            "torch.npu.FloatTensor", "torch.float32", "cpu"]
    assert "torch.npu.not_an_api is not implemented by the torch_npu stand-in" in out["torch.npu.not_an_api"]
    assert "torch_npu.npu_not_an_operator is not implemented" in out["torch_npu.npu_not_an_operator"]
    if out.get("builder") != "mindspeed not installed":
        assert {"npu_gmm", "npu_gmm_backward"} <= set(out["builder_known"])
        assert out["builder"].startswith("MissingKernel: MindSpeed op builder 'grouped_matmul'")


@needs_npu_stack
def test_verls_initializer_builds_the_npu_model_with_no_dummy_module_and_it_trains():
    proc = run(str(REPO / "tests/npu_rehearsal/npu_path_build.py"))
    out = result(proc)
    # The spec record walked the layer spec before the build, found no dummy, and printed each class's release.
    table = proc.stdout.split("DeepSeek-V3's layer spec on Ascend resolves to", 1)[1]
    assert ("layer.self_attention: mindspeed_llm.tasks.models.transformer.multi_latent_attention.CustomMLASelfAttention "
            "[mindspeed_llm v2.2.0 (53f3639c3da9)]") in table
    assert "core_attention: mindspeed_llm.tasks.models.transformer.mla_dot_product_attention.MlaDotProductAttention" in table
    assert ("layer.mlp.experts: mindspeed.core.transformer.moe.moe_feature.adaptor.MindSpeedGmmExperts "
            "[mindspeed v2.2.0_core_r0.12.1") in table
    assert ": transformer_engine." not in table and ": verl_patches.rigs.cpu." not in table and "[?]" not in table
    assert out["dummies"] == []
    assert not any(c.startswith("megatron.core.extensions.transformer_engine") for c in out["classes"])
    assert {"mindspeed_llm.tasks.models.transformer.multi_latent_attention.CustomMLASelfAttention",
            "mindspeed.core.transformer.moe.moe_feature.adaptor.MindSpeedGmmExperts"} <= set(out["classes"])
    assert out["shape"] == [1, 16, 1000] and out["finite"] and out["no_grad"] == []
    assert out["torch_npu"].startswith("torch_npu: STAND-IN")
    # Through the overlay's records: the spec record and the binding (Megatron's arguments from verl's config).
    assert {"verl.deepseek_v3_mindspeed_llm_layer_spec", "verl.recipe_megatron.binding"} <= set(out["applied"])
    assert out["spec"] == ["mindspeed_llm.tasks.models.spec.deepseek_spec", "layer_spec"] and out["seq_length"] == 64
    # MindSpeed-LLM's fused MLA down-projection (q_down + kv_down in one linear_qkv) and grouped experts.
    assert out["params"]["decoder.layers.1.self_attention.linear_qkv.weight"] == [48 + 32 + 8, 64]
    assert "decoder.layers.1.mlp.experts.weight1" in out["params"]


@needs_npu_stack
def test_an_operator_removed_from_the_stand_in_fails_the_path_naming_it():
    proc = run(str(REPO / "tests/npu_rehearsal/npu_path_build.py"), DROP_OPERATOR="npu_swiglu")
    assert proc.returncode != 0
    assert "torch_npu.npu_swiglu is not implemented by the torch_npu stand-in" in proc.stderr


@needs_npu_stack
def test_verls_worker_seeds_and_builds_the_npu_model_after_the_whole_prelude_in_its_own_order():
    # verl's worker module, the prelude at its end, ActorRolloutRefWorker.__init__ (seeds megatron-core), the binding.
    out = result(run(str(REPO / "tests/npu_rehearsal/npu_path_worker.py")))
    assert out["verl_device"] == "npu" and out["mindspeed_llm_at_rank_start"]
    # The records on MindSpeed and megatron's jit_fuser before the adaptor, then the rest (verl's actor module too).
    assert out["applied"][:3] == ["megatron.jit_fuser_mindspeed_compile", "mindspeed.recipe_megatron_args",
                                  "mindspeed.no_megatron_text_generation"]
    assert {"verl.recipe_megatron.binding", "verl.old_log_prob.minibatch",
            "verl.deepseek_v3_mindspeed_llm_layer_spec"} <= set(out["applied"])
    assert "model-parallel-rng" in out["rng_tracker"]
    assert "mindspeed_llm.tasks.models.transformer.multi_latent_attention.CustomMLASelfAttention" in out["classes"]
    assert out["shape"] == [1, 16, 1000] and out["finite"] and out["no_grad"] == []
    assert out["params"]["decoder.layers.1.self_attention.linear_qkv.weight"] == [48 + 32 + 8, 64]
    assert out["spec"] == ["mindspeed_llm.tasks.models.spec.deepseek_spec", "layer_spec"] and out["seq_length"] == 64
    # MindSpeed's bare flash_attn is still registered: verl, having decided npu, never asks it for bert_padding.
    assert out["flash_attn_is_package"] is False


@needs_npu_stack
def test_the_npu_model_loads_the_tiny_assets_mindspeed_llm_checkpoint(tmp_path):
    """Names end to end: the tiny assets' checkpoint for the NPU path (hf_to_mcore --spec mindspeed_llm, chunked
    for TP2 x PP2 x EP2) holds every key MindSpeed-LLM's DeepSeek model asks for, in its shapes; verl's loader
    fills the model with it (one rank)."""
    from verl_patches.rigs.tiny import assets

    paths = assets.build(tmp_path / "assets", "mindspeed_llm")
    out = result(run(str(REPO / "tests/npu_rehearsal/npu_ckpt_load_worker.py"), str(paths["MODEL_PATH"]),
                     str(paths["DIST_CKPT_PATH"])))
    assert out["missing"] == [] and out["shapes"] == [] and out["missing_objects"] == []
    assert out["load_error"] is None and out["checked"] >= out["wanted"] > 0
    assert out["params"]["decoder.layers.1.self_attention.linear_qkv.weight"] == [48 + 32 + 8, 64]
    # Every tensor holds the checkpoint's values, the routed experts' included: GroupedMLP's (MindSpeedGmmExperts')
    # weight1 / weight2 are a ShardedTensorFactory, built for the load and returned merged; verl's own loader dropped
    # that return (found 2026-11-28), the recipe's (patch verl.model.load_hands_back) copies it into the model.
    assert out["differ"] == [] and out["unloaded"] == []
    # The logits agree with transformers' model of the same weights; the down projection's rows in the other order
    # do not.
    assert out["logits"]["loaded"]["cosine"] > 0.99 and out["logits"]["rows_swapped"]["cosine"] < 0.5


VERL_AFTER_TRANSFER_TO_NPU = """
from verl_patches.prelude import boot_rehearsal
boot_rehearsal()
from torch_npu.contrib import transfer_to_npu  # torch.cuda.is_available() answers the NPU's from here on
import verl.utils.device  # verl decides "cuda" (its actor modules would then import flash_attn.bert_padding)
from verl_patches.prelude import apply_prelude
apply_prelude("worker")
"""


@needs_npu_stack
def test_verl_deciding_its_device_after_transfer_to_npu_is_refused_naming_the_order():
    proc = run(VERL_AFTER_TRANSFER_TO_NPU, VERL_PATCHES_PHASE="worker")
    assert proc.returncode != 0
    assert "verl decided its device as 'cuda' before MindSpeed-LLM's adaptor" in proc.stderr


@needs_npu_stack
def test_the_doctor_judges_torch_npu_and_cann_stood_in_on_the_rehearsal_and_missing_off_it():
    doctor = "import sys, runpy; sys.argv = ['verl_patches', 'doctor', '--platform', 'npu']; " \
             "runpy.run_module('verl_patches', run_name='__main__')"
    on = run(doctor)
    for key in ("torch_npu", "cann"):
        assert re.search(rf"^stood-in +lock:{key} .*the NPU rehearsal platform stands in for it", on.stdout, re.M), \
            on.stdout[-3000:]
    # On the NPU platform the doctor resolves the recipe's 256-die layer spec (a child process, world 256), every
    # class a real implementation with its release (issue 35, item 6).
    assert re.search(r"^ok +layer-spec +configs/deepseekv3_256die_random_init\.yaml: \d+ classes, each a real "
                     r"implementation, from .*mindspeed v2\.2\.0_core_r0\.12\.1.*mindspeed_llm v2\.2\.0", on.stdout, re.M), \
        on.stdout[-3000:] + on.stderr[-3000:]
    assert "layer spec of deepseekv3_256die_random_init (world 256," in on.stdout
    assert re.search(r"^  layer\.mlp\.experts: mindspeed\..*MindSpeedGmmExperts \[mindspeed v2\.2\.0_core_r0\.12\.1",
                     on.stdout, re.M), on.stdout[-3000:]
    off = run(doctor, VERL_PATCHES_PLATFORM="")
    assert not re.search(r"^stood-in", off.stdout, re.M) and re.search(r"^missing +lock:cann", off.stdout, re.M)
    # The stand-in on the path but the rehearsal not selected: the spec is not resolved, naming the stand-in's refusal
    # (tests/core/test_doctor_cli.py: without any torch_npu the finding defers to the lock's line).
    assert re.search(r"^invalid +layer-spec .*not resolved: ImportError: this torch_npu is the NPU rehearsal platform's "
                     r"STAND-IN", off.stdout, re.M), off.stdout[-3000:]


@needs_npu_stack
def test_the_layer_spec_report_refuses_a_dummy_naming_its_slot():
    """The command's refusal, end to end: MindSpeed-LLM's spec module is replaced (a declared test stand-in,
    tests/npu_rehearsal/layer_spec_with_dummy.py) by one whose experts slot is a bare torch.nn.Module, as MindSpeed
    2.1.0 registered Transformer Engine's classes (issue 35's reproduction)."""
    proc = run(str(REPO / "tests/npu_rehearsal/layer_spec_with_dummy.py"), "--config-name", "deepseekv3_256die_random_init")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "layer.mlp.experts: torch.nn.modules.module.Module" in proc.stdout
    assert re.search(r"^error: 1 class\(es\) of the layer spec are not real implementations:\n  layer\.mlp\.experts: "
                     r"resolves to torch\.nn\.Module itself \(a dummy", proc.stderr, re.M), proc.stderr[-3000:]


def test_the_layer_spec_report_refuses_off_the_npu_naming_the_platforms(capsys, monkeypatch):
    from verl_patches.checks import layer_spec

    monkeypatch.setenv("VERL_PATCHES_DEVICE", "cpu")
    monkeypatch.delenv("VERL_PATCHES_PLATFORM", raising=False)
    assert layer_spec.main([]) == 1
    err = capsys.readouterr().err
    assert "the layer spec is Ascend's and this process runs on cpu" in err and "VERL_PATCHES_PLATFORM=npu-rehearsal" in err
