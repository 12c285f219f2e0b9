"""The rollout's long tail: rebalancing unfinished requests between the DP ranks of one rollout so the
DP group drops to a smaller captured graph size (docs/ROLLOUT.md).

``rebalance`` is the policy (pure functions); ``simulator`` the offline rollout simulator behind
``python -m verl_patches rollout-plan``; ``migrate`` the mechanism (the lockstep move, run by the CPU
generation stand-in), ``kv_transfer`` its transfer of a request's state between ranks; ``vllm_move`` and
``kv_blocks`` the move inside vLLM V1's engine (scheduler, worker, paged KV blocks). Two modules import
it (tests/test_import_graph.py): the CPU generation stand-in, which runs the rebalance, and the rollout
patch, which reads ``recipe.rebalance`` through it and refuses it on a device today.
"""
