"""What the forkserver of ``run_distributed`` imports once, before it forks any rank
(``VERL_PATCHES_RANK_START=forkserver``; verl_patches/launch/local_ranks.py).

A spawned rank is a fresh interpreter that imports torch (and, for most ranks of the tests, megatron-core
and vLLM) on its own: 3 to 13 s of CPU each, paid hundreds of times by the test suite on a 2-core
machine. A forked rank starts with the server's modules already imported. The server is single-threaded
Python when it forks (multiprocessing's forkserver), which is what makes forking after these imports safe.
Only gloo ranks fork (``launch._context``): a device runtime cannot be used in a child forked from a
process that touched it, and asking torch how many GPUs there are already counts as touching it.

The modules are ``VERL_PATCHES_RANK_PRELOAD`` (default torch). A module that fails to import is recorded
in ``FAILED`` (the forkserver would drop the error silently) and the launcher names it: the ranks would
import it themselves and fail there, or pay for it again.

Importing some of them sets environment variables (vLLM sets NCCL_CUMEM_ENABLE, Ray RAY_CLIENT_MODE): a
rank takes its caller's environment (``rank_boot.main``), plus what these imports set and the caller
does not, as a spawned rank that imported them would have.
"""

from __future__ import annotations

import importlib
import os

from verl_patches.base import env

_BEFORE = dict(os.environ)


def _load() -> tuple[tuple[str, ...], dict[str, str]]:
    # Nothing may escape: an exception here would end the forkserver, and the caller would see only
    # a broken pipe. Failures are named to the ranks instead.
    try:
        names = env.get("VERL_PATCHES_RANK_PRELOAD")
    except Exception as e:  # noqa: BLE001
        return (f"VERL_PATCHES_RANK_PRELOAD: {e}",), {}
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported by the launcher, with the module named
            failed.append(f"{name}: {type(e).__name__}: {e}")
    return tuple(failed), {k: v for k, v in os.environ.items() if _BEFORE.get(k) != v}


FAILED, ENV_SET_BY_IMPORTS = _load()
