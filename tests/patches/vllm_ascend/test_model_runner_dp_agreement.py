"""vLLM-Ascend's DP forward agreement on the device group (patch vllm_ascend.dp_sync.forward_metadata_on_device).

vllm_ascend.worker.model_runner_v1 imports torch_npu, so the patch cannot be applied here and the
real NPUModelRunner cannot be built: the record is checked against the installed source file (as
the doctor does), the wrapper's fallbacks are exercised with a stand-in runner, and its device
path runs on vLLM's real DP groups in tests/patches/vllm/test_dp_domain_dist.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from verl_patches.core.apply import PatchError, apply_all
from verl_patches.core.fingerprint import fingerprint_file
from verl_patches.patches.vllm_ascend.patch_worker_model_runner_v1 import PATCHES, wrap_get_forward_metadata_across_dp
from verl_patches.rollout.dp_sync import FLAG_ENV


def _installed_file() -> Path:
    spec = importlib.util.find_spec("vllm_ascend")
    return Path(spec.submodule_search_locations[0]) / "worker" / "model_runner_v1.py"


def test_record_matches_the_installed_source():
    (patch,) = PATCHES
    assert fingerprint_file(_installed_file(), patch.qualname) == patch.fingerprint
    assert patch.platforms == ("npu",)


def test_applying_off_ascend_fails_loudly_not_silently():
    with pytest.raises(PatchError, match="cannot be imported"):
        apply_all(PATCHES)


def _runner(**kw):
    base = dict(dp_size=4, dp_rank=1, is_kv_producer=False, is_kv_consumer=False, torchair_graph_enabled=True)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("runner,flag", [
    (_runner(dp_size=1, dp_rank=0), None),  # no DP: nothing to agree on
    (_runner(is_kv_producer=True), None),  # disaggregated prefill keeps upstream's paths
    (_runner(is_kv_consumer=True), None),
    (_runner(), "0"),  # flag off
])
def test_upstream_paths_reach_the_original(runner, flag, monkeypatch):
    if flag is None:
        monkeypatch.delenv(FLAG_ENV, raising=False)
    else:
        monkeypatch.setenv(FLAG_ENV, flag)
    calls = []

    def original(self, padded, num, prefill, dbo):
        calls.append((self, padded, num, prefill, dbo))
        return "upstream"

    assert wrap_get_forward_metadata_across_dp(original)(runner, 8, 5, False, True) == "upstream"
    assert calls == [(runner, 8, 5, False, True)]


def test_without_a_vllm_dp_group_the_original_runs(monkeypatch):
    # A process where vLLM built no DP group (e.g. model-parallel state destroyed): upstream path.
    from vllm.distributed import parallel_state as ps

    monkeypatch.delenv(FLAG_ENV, raising=False)
    monkeypatch.setattr(ps, "_DP", None)
    out = wrap_get_forward_metadata_across_dp(lambda *a: "upstream")(_runner(), 8, 5, False, True)
    assert out == "upstream"
