"""Shared test setup: the real upstream stack on CPU (see verl_patches/testing/upstream_env.py)."""

import os

os.environ.setdefault("VLLM_PLUGINS", "verl_patches")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from verl_patches.testing.upstream_env import prepare_cpu_upstream  # noqa: E402

prepare_cpu_upstream()
