"""The NPU rehearsal platform's torch_npu.profiler stand-in (verl_patches/rigs/npu_rehearsal/site/torch_npu/profiler/):
the accelerator facade's NPU branch (verl_patches/base/accelerator.py, ``profiler``) runs on it as on an NPU,
torch_npu's calls answered by torch's profiler on the host, a readable chrome trace written; a name the stand-in
does not declare, or an argument torch_npu does not take, fails loudly. In its own process (activation renames
torch's PrivateUse1 backend), as tests/npu_rehearsal/test_platform.py runs the device API."""

from __future__ import annotations

from tests.npu_rehearsal.test_platform import result, run

PROFILE = """
import json, os, tempfile, torch
from verl_patches.rigs import npu_rehearsal
npu_rehearsal.activate()
import torch_npu
from torch_npu.contrib import transfer_to_npu
from verl_patches.base import accelerator
out = {"device": accelerator.device_type(), "stand_in": torch_npu.profiler.__name__}
d = tempfile.mkdtemp()
with accelerator.profiler(d, "rank0", "level2"), accelerator.profiler_label("recipe/update"):
    torch.ones(8, 8, device="npu:0") @ torch.ones(8, 8, device="npu:0")
out["files"] = sorted(os.listdir(d))
with open(os.path.join(d, out["files"][0])) as f:
    out["names"] = sorted({e.get("name") for e in json.load(f)["traceEvents"]} & {"recipe/update", "aten::mm"})
p = torch_npu.profiler
out["level"] = p._ExperimentalConfig(profiler_level=p.ProfilerLevel.Level2).level
for name, call in [("missing", lambda: p.dynamic_profile),
                   ("config", lambda: p.profile(experimental_config=object())),
                   ("activity", lambda: p.profile(activities=[torch.profiler.ProfilerActivity.CPU])),
                   ("bad_level", lambda: p._ExperimentalConfig(profiler_level="Level9")),
                   ("undocumented", lambda: p._ExperimentalConfig(profiler_level=p.ProfilerLevel.Level1, aic_metrics=1))]:
    try:
        call()
        out[name] = "no error"
    except Exception as err:
        out[name] = f"{type(err).__name__}: {err}"
print("RESULT " + json.dumps(out))
"""


def test_the_facades_npu_profiler_runs_on_the_stand_in_and_writes_a_chrome_trace():
    out = result(run(PROFILE))
    assert out["device"] == "npu" and out["stand_in"] == "torch_npu.profiler"
    (trace,) = out["files"]
    assert trace.startswith("rank0.") and trace.endswith(".pt.trace.json")
    assert out["names"] == ["aten::mm", "recipe/update"]
    assert out["level"] == "Level2"
    assert out["missing"].startswith("AttributeError: torch_npu.profiler.dynamic_profile is not implemented by the "
                                     "torch_npu stand-in")
    assert out["config"] == ("TypeError: torch_npu.profiler.profile: experimental_config must be a "
                             "torch_npu.profiler._ExperimentalConfig, got object")
    assert out["activity"].startswith("TypeError: torch_npu.profiler.profile: activities must be "
                                      "torch_npu.profiler.ProfilerActivity members")
    assert out["bad_level"].startswith("ValueError: torch_npu.profiler._ExperimentalConfig: profiler_level 'Level9' "
                                       "is not a ProfilerLevel")
    assert out["undocumented"].startswith("TypeError: ") and "aic_metrics" in out["undocumented"]
