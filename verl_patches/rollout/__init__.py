"""Framework-free pieces of the recipe's vLLM rollout: the DP domain (``dp_domain``), the DP agreement on
the device group (``dp_sync``), the KV cache freed and re-created every step (``kv_cache``), the engine's
memory under the switch loop (``engine_memory``), graph-safe regions (``graph_safe``, ``worker_regions``),
MLA's derived tensors (``mla``), the real ``torch.compile`` for the rollout under MindSpeed
(``compile_context``) and the rollout's settings (``settings``).

Plain torch / torch.distributed; the patch modules under verl_patches/patches/ bind them to vLLM and verl.
The long tail's rebalance (policy, simulator, move mechanism, KV transfer) is its own wing, ``long_tail/``:
the CPU generation stand-in runs it, vLLM's engine on a device refuses it today (docs/ROLLOUT.md).
"""
