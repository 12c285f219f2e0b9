"""Per-rank body for test_dp_domain.py (next to it): spawned processes import it by name."""

from __future__ import annotations

import os


def setup_rank(rank: int, world: int, spec_fields: dict) -> dict:
    from verl_patches.rollout.dp_domain import DPDomainError, DPSpec, setup_dp_domain

    env: dict = {}
    try:
        d = setup_dp_domain(DPSpec(**spec_fields), f"10.0.0.{rank}", environ=env)
    except DPDomainError as e:
        return {"error": str(e), "published": sorted(k for k in os.environ if k.startswith("VLLM_DP_"))}
    return {"port": d.master_port, "env": env}


def setup_free_then_taken(rank: int, world: int, spec_fields: dict) -> dict:
    """Both cases in one spawn: the ports free, then one of them taken on the master (rank 0)."""
    import socket

    import torch.distributed as dist

    ok = setup_rank(rank, world, spec_fields)
    dist.barrier()
    held = socket.socket()
    try:
        if rank == 0:
            held.bind(("", spec_fields["master_port_base"] + 2))
            held.listen()
        dist.barrier()
        refused = setup_rank(rank, world, spec_fields)
        dist.barrier()
    finally:
        held.close()
    return {"ok": ok, "refused": refused}
