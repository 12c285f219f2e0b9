"""The DP-domain arithmetic and checks (single process; the 8-process run against real vLLM groups
is tests/patches/vllm/test_dp_domain_dist.py)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

from verl_patches.rollout.dp_domain import (DOMAIN_ENV, DPDomainError, DPSpec, check_vllm_config, check_vllm_groups,
                                            derive_dp_domain, master_addr_of)
from verl_patches.rollout.dp_sync import FLAG_ENV, dp_sync_on_device
from verl_patches.launch.local_ranks import free_port_block, run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import the body by name
from dp_domain_ranks import setup_free_then_taken  # noqa: E402


def _vllm_layout(world: int, dp: int, tp: int):
    """vLLM 0.9.1's layout written independently: ranks as ExternalDP x DP x PP(1) x TP."""
    grid = torch.arange(world).reshape(-1, dp, 1, tp)
    dp_groups = [g.tolist() for g in grid.transpose(1, 3).reshape(-1, dp).unbind(0)]
    ep_groups = [g.tolist() for g in grid.transpose(1, 2).reshape(-1, dp * tp).unbind(0)]
    return dp_groups, ep_groups


@pytest.mark.parametrize("instances,dp,tp", [(1, 128, 2), (2, 64, 2), (1, 4, 1), (3, 2, 4), (2, 1, 2)])
def test_groups_match_vllm_layout_and_ports_are_distinct_per_group(instances, dp, tp):
    spec = DPSpec(tp_size=tp, dp_size=dp, instances=instances, master_port_base=20000, port_stride=3)
    world = spec.world_size
    dp_groups, ep_groups = _vllm_layout(world, dp, tp)
    doms = [derive_dp_domain(r, world, spec) for r in range(world)]
    for r, d in enumerate(doms):
        assert list(d.dp_group) == next(g for g in dp_groups if r in g)
        assert list(d.ep_group) == next(g for g in ep_groups if r in g)
        assert d.dp_group.index(r) == d.dp_rank and d.master_rank == d.dp_group[0]
    port_of_group = {}
    for d in doms:
        port_of_group.setdefault(d.dp_group, set()).add(d.master_port)
    assert all(len(p) == 1 for p in port_of_group.values())  # members agree
    ports = sorted(next(iter(p)) for p in port_of_group.values())
    assert len(ports) == instances * tp and all(b - a >= 3 for a, b in itertools.pairwise(ports))


def test_env_is_what_vllm_reads():
    spec = DPSpec(tp_size=2, dp_size=4, instances=2, master_port_base=30000)
    d = derive_dp_domain(11, 16, spec)  # instance 1, DP rank 1, TP rank 1
    env = d.env("10.0.0.8")
    assert (d.instance, d.dp_rank, d.tp_rank, d.group_index) == (1, 1, 1, 3)
    assert env["VLLM_DP_SIZE"] == "4" and env["VLLM_DP_RANK"] == "1" and env["VLLM_DP_MASTER_IP"] == "10.0.0.8"
    assert env["VLLM_DP_MASTER_PORT"] == str(30000 + 3 * spec.port_stride)
    assert DPSpec.from_env({DOMAIN_ENV: env[DOMAIN_ENV]}) == spec
    assert DPSpec.from_env({}) is None
    addrs = [f"h{r // 4}" for r in range(16)]  # 4 ranks per host
    assert master_addr_of(d, addrs) == addrs[d.dp_group[0]] == "h2"


@pytest.mark.parametrize("kwargs,world,rank,match", [
    (dict(tp_size=2, dp_size=4), 16, 0, "= 8 ranks, but the world has 16"),
    (dict(tp_size=2, dp_size=4), 8, 8, "outside the world of 8"),
    (dict(tp_size=0, dp_size=4), 8, 0, "tp_size must be a positive integer"),
    (dict(tp_size=2, dp_size=4, master_port_base=80), 8, 0, "master_port_base"),
    (dict(tp_size=2, dp_size=4, master_port_base=65530, port_stride=4), 8, 0, "need ports up to"),
])
def test_bad_domains_are_refused_by_name(kwargs, world, rank, match):
    with pytest.raises(DPDomainError, match=match):
        derive_dp_domain(rank, world, DPSpec(**kwargs))


def test_bad_env_description_is_named():
    with pytest.raises(DPDomainError, match=DOMAIN_ENV):
        DPSpec.from_env({DOMAIN_ENV: "{not json"})


def test_config_and_group_checks_name_the_mismatch():
    spec = DPSpec(tp_size=2, dp_size=2, instances=2)
    d = derive_dp_domain(5, 8, spec)  # instance 1, DP rank 0, TP rank 1
    check_vllm_config(d, 2, 0, 2, 1)
    with pytest.raises(DPDomainError, match="data_parallel_rank is 1.*DP rank 0"):
        check_vllm_config(d, 2, 1, 2, 1)
    with pytest.raises(DPDomainError, match="pipeline_parallel_size is 2"):
        check_vllm_config(d, 2, 0, 2, 2)
    check_vllm_groups(d, [5, 7], [4, 5, 6, 7], [4, 5])
    with pytest.raises(DPDomainError, match=r"EP group \[4, 5\] != \[4, 5, 6, 7\]"):
        check_vllm_groups(d, [5, 7], [4, 5], [4, 5])


def test_flag_parsing(monkeypatch):
    monkeypatch.delenv(FLAG_ENV, raising=False)
    assert dp_sync_on_device()  # the recipe's default
    for raw, want in (("0", False), ("false", False), ("1", True), ("On", True)):
        monkeypatch.setenv(FLAG_ENV, raw)
        assert dp_sync_on_device() is want
    monkeypatch.setenv(FLAG_ENV, "maybe")
    with pytest.raises(ValueError, match=FLAG_ENV):
        dp_sync_on_device()


def test_setup_publishes_the_masters_address_or_names_a_taken_port_on_every_rank():
    """Two gloo processes, DP2: rank 0 hosts the group's rendezvous. With its ports free both ranks
    publish rank 0's address; with one taken, both refuse naming it (instead of rank 1 waiting in
    vLLM's rendezvous until the store times out) and nothing is published."""
    base = free_port_block(4)
    spec = dict(tp_size=1, dp_size=2, master_port_base=base, port_stride=4)
    res = run_distributed(setup_free_then_taken, 2, spec, timeout=180)
    ok, refused = [r["ok"] for r in res], [r["refused"] for r in res]
    assert [r["env"]["VLLM_DP_MASTER_IP"] for r in ok] == ["10.0.0.0"] * 2
    assert [r["env"]["VLLM_DP_RANK"] for r in ok] == ["0", "1"] and {r["port"] for r in ok} == {base}
    for r in refused:
        assert f"DP group 0 (master: global rank 0 on 10.0.0.0) needs ports {base}-{base + 3}, but [{base + 2}] is " \
               "in use there" in r["error"], r["error"]
        assert r["published"] == []


def test_a_master_port_block_in_the_ephemeral_range_is_warned_about(monkeypatch, caplog):
    import verl_patches.base.ports as ports
    from verl_patches.rollout.dp_domain import check_master_ports

    base = free_port_block(4)
    spec = DPSpec(tp_size=1, dp_size=2, master_port_base=base, port_stride=4)
    master, member = derive_dp_domain(0, 2, spec), derive_dp_domain(1, 2, spec)
    with caplog.at_level("WARNING", logger="verl_patches.rollout.dp_domain"):
        assert check_master_ports(master, "h0") == "" and not caplog.records
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (base + 3, 60999))  # the block's last port
        assert check_master_ports(master, "h0") == ""
        assert check_master_ports(member, "h0") == ""  # only the master checks (and warns)
    assert len(caplog.records) == 1 and f"ports {base}-{base + 3} lie in this host's ephemeral" in caplog.text
