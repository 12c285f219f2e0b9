"""The test helpers, used by tests/ and scripts only (production code never imports them:
tests/test_import_graph.py). ``live_models`` (real megatron-core and vLLM models on the CPU), ``binding_check``,
``fingerprint_check``, ``selfcheck``, ``graph_switch`` and ``optimizer_offload`` (what one spawned rank of a test
runs), ``groupcheck`` (the process groups upstream builds for a layout), ``upstream_env`` (the real upstream
stack importable in the CPU test environment) and ``stop_on_sigterm`` (the pytest plugin that stops a run on
SIGTERM or SIGHUP).
"""
