"""The vLLM DP domain on 8 gloo processes: real vLLM groups, one distinct port per DP group, and the
DP agreements on the device group (patches vllm.parallel_state.dp_domain, vllm.dp_sync.*)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from verl_patches.launch.local_ranks import free_port_block, run_distributed

# The per-rank body must be importable by name in the spawned processes, which inherit sys.path;
# site-packages holds an unrelated `tests` package, so it cannot be reached as tests.patches.vllm.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_dp_domain_rank import dp_domain_rank  # noqa: E402

# Multi-process or Ray: the slow tier (README: fast tier = -m 'not slow').
pytestmark = pytest.mark.slow

W = 8
INSTANCES, DP, TP = 2, 2, 2  # the real-weight run's shape in small: 2 instances x DP x TP2


def _spec() -> dict:
    # Every port the DP groups may use is free now and below the ephemeral range, so none of the
    # job's own gloo connections can be holding it when a group's rendezvous binds it.
    stride = 4
    base = free_port_block(INSTANCES * TP * stride)
    return dict(tp_size=TP, dp_size=DP, instances=INSTANCES, master_port_base=base, port_stride=stride)


@pytest.fixture(scope="module")
def ranks():
    spec = _spec()
    return spec, run_distributed(dp_domain_rank, W, spec, env={"VLLM_PLUGINS": "verl_patches"}, timeout=280)


def test_every_patch_was_applied(ranks):
    _, out = ranks
    assert all(r["applied"] == ["vllm.parallel_state.dp_domain", "vllm.dp_sync.unfinished_on_device",
                                "vllm.dp_sync.tokens_on_device"] for r in out)


def test_vllm_builds_the_domains_groups_and_config(ranks):
    spec, out = ranks
    per_instance = DP * TP
    for r, res in enumerate(out):
        g, d = res["groups"], res["domain"]
        # vLLM's own groups: DP strided by TP inside an instance, EP = the whole instance.
        assert g["dp"] == d["dp_group"] == [r - (r % per_instance) + k * TP + r % TP for k in range(DP)]
        assert g["ep"] == d["ep_group"] == list(range(r - r % per_instance, r - r % per_instance + per_instance))
        assert g["tp"] == [r - r % TP + k for k in range(TP)]
        assert g["dp_rank_in_group"] == d["dp_rank"] == res["config"]["dp_rank"]
        assert res["config"]["dp_size"] == DP
        assert res["stateless"] == {"size": DP, "rank": d["dp_rank"]}


def test_every_dp_group_agrees_on_a_distinct_port(ranks):
    spec, out = ranks
    by_group: dict[int, set] = {}
    for res in out:
        by_group.setdefault(res["domain"]["group_index"], set()).add(
            (res["config"]["master_ip"], res["config"]["master_port"], tuple(res["domain"]["dp_group"])))
    assert sorted(by_group) == list(range(INSTANCES * TP))
    assert all(len(v) == 1 for v in by_group.values()), by_group  # every member agrees
    ports = [next(iter(v))[1] for v in by_group.values()]
    assert len(set(ports)) == len(ports)
    # Each group may consume port_stride ports (vLLM bumps the port per rendezvous): no overlap.
    ranges = sorted((p, p + spec["port_stride"]) for p in ports)
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(next(iter(v))[0] == "127.0.0.1" for v in by_group.values())


def test_stale_config_is_refused_with_the_patch_and_builds_wrong_ep_without(ranks):
    _, out = ranks
    for r, res in enumerate(out):
        assert "data_parallel_size is 1" in res["stale_patched"], res["stale_patched"]
        # Upstream alone silently shrinks EP to the TP pair: experts would not span the dies.
        assert res["stale_unpatched_ep"] == [r - r % TP + k for k in range(TP)]


def test_unfinished_agreement_runs_on_the_device_group(ranks):
    _, out = ranks
    for res in out:
        expected = res["domain"]["group_index"] == 0
        assert res["unfinished"] is expected
        assert res["unfinished_groups"] == ["device"]
        # Flag off: upstream's stateless gloo group, same answer.
        assert res["unfinished_flag_off"] is expected and res["flag_off_groups"] == ["stateless"]
        # Without the patch the all-reduce is upstream's: the test above fails then.
        assert res["unfinished_unpatched"] is expected and res["unpatched_groups"] == ["stateless"]


def test_token_counts_agree_on_the_device_group(ranks):
    _, out = ranks
    for res in out:
        expected = [100 + m for m in res["domain"]["dp_group"]]
        assert res["tokens"] == expected and res["tokens_groups"] == ["device"]
        assert res["tokens_unpatched"] == expected and res["tokens_unpatched_groups"] == ["cpu"]


def test_vllm_ascend_forward_agreement_on_the_device_group(ranks):
    """The wrapper's logic on vLLM's real DP groups; the real NPUModelRunner cannot be built
    without torch_npu, so a stand-in carries the runner attributes the wrapper reads."""
    _, out = ranks
    for r, res in enumerate(out):
        members = res["domain"]["dp_group"]
        prefill = res["domain"]["group_index"] == 0  # DP rank 1 of group 0 prefills
        for torchair in (False, True):
            a = res[f"agree_torchair_{torchair}"]
            assert a["prefill"] is prefill and a["device"] == "cpu"
            assert a["dbo"] is (2 not in members)
            if prefill:  # nobody pads once a rank prefills
                assert a["counts"] == [m + 1 for m in members] and a["local"] == r + 1
            else:
                assert a["counts"] == [16] * DP and a["local"] == 16
        assert res["agree_groups"] == ["device", "device"]
