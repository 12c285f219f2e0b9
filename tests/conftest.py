"""Shared test setup: the real upstream stack on CPU (see verl_patches/rigs/testing/upstream_env.py)."""

import os
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
# `from tests.helpers import ...` and the patch fixtures, under --import-mode=importlib.
for _p in (_REPO / "tests" / "fixtures", _REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

os.environ.setdefault("VLLM_PLUGINS", "verl_patches")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# megatron-core's import applies torch.compile, which makes torch pre-fork inductor compile
# workers in every process; the tests compile nothing, and on 2 cores those pools hurt.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The tests start hundreds of local ranks (verl_patches/launch/local_ranks.py:run_distributed): forked from a server
# that imported torch, megatron-core and vLLM once instead of each importing them (3-13 s of CPU a rank).
# tests/test_launch.py runs the spawn start (the default) as well.
# Only what this machine has: the GPU machines' image has no vLLM (a preload that fails fails the ranks).
import importlib.util  # noqa: E402


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a missing parent package
        return False


# On the CPU platform only: on a GPU machine megatron-core's import initialises CUDA, which a forked rank
# cannot use (verl_patches/launch/rank_preload.py refuses that preload); the GPU tests spawn their ranks.
from verl_patches.base import accelerator as _accelerator  # noqa: E402

if _accelerator.device_type() == "cpu":
    os.environ.setdefault("VERL_PATCHES_RANK_START", "forkserver")
    os.environ.setdefault("VERL_PATCHES_RANK_PRELOAD", ",".join(
        m for m in ("torch", "torch.distributed", "megatron.core", "vllm") if _installed(m)))

from verl_patches.rigs.testing.upstream_env import prepare_cpu_upstream  # noqa: E402

prepare_cpu_upstream()

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test ends with the process environment it started with. An entry point run in-process (a CLI's
    main, a rank function) may set variables for the processes it starts (the preflight's VERL_PATCHES_DEVICE);
    left behind, they reach every subprocess a later test in this worker starts -- which tests share a worker
    depends on timing, so such a leak fails only sometimes (it did in CI: VERL_PATCHES_DEVICE=cpu turned the
    NPU rehearsal's subprocesses into CPU runs)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _fresh_switch_loop():
    """Each test starts with a fresh process-wide switch loop (verl_patches/offload/live.py): the
    memory objects one test attaches must not be members of the next test's loop."""
    yield
    import sys as _sys

    live = _sys.modules.get("verl_patches.offload.live")
    if live is not None:
        live.reset_live_switch()


# The longest files first, longest first: under pytest-xdist (scripts/test.sh: two workers, a file at a time) a
# long file handed out last runs alone at the end (a 13-minute tail in CI once). Then the rest of the slow tier,
# then the fast tier; collection order otherwise. Seconds per file from a clean 2-core run (2026-11-27, durations).
_FIRST = (
    "tests/recipe/test_train_tiny.py",  # 562
    "tests/recipe/test_multinode_rehearsal.py",  # 456
    "tests/recipe/test_train_tiny_dynamic_bsz.py",  # 344
    "tests/recipe/test_multinode_node_loss.py",  # 335
    "tests/npu_rehearsal/test_tiny_run.py",  # 95 alone with 2 steps (2026-11-28); 6 steps since
    "tests/recipe/test_launchers.py",  # 306
    "tests/test_scripts.py",  # 348, of which 215 the eight-worker measure_tensorcache_bytes.py, since two
    "tests/preflight/test_preflight.py",  # 175
    "tests/recipe/test_cluster_checks.py",  # 129
    "tests/test_launch_teardown.py",  # 118
    "tests/core/test_prelude.py",  # 100
    "tests/npu_rehearsal/test_platform.py",  # 81
)


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        path = item.nodeid.split("::", 1)[0]
        if path in _FIRST:
            return _FIRST.index(path)
        return len(_FIRST) + (0 if item.get_closest_marker("slow") else 1)

    items.sort(key=rank)  # stable: the order within each group is pytest's


def pytest_xdist_make_scheduler(config, log):
    """scripts/test.sh's --dist loadfile, its files handed out in the order above. xdist's own file scheduling
    orders them by their number of tests, most first (xdist/scheduler/loadscope.py: schedule), which put the
    multi-node rehearsal's three tests of 13 minutes last."""
    if config.getoption("dist", None) != "loadfile":
        return None
    import xdist
    from xdist.scheduler import LoadFileScheduling

    # The ordering below overrides a private method of xdist's scheduler (pinned in requirements-test.txt);
    # a release without it would silently fall back to xdist's order, so it is an error naming the pin.
    if not callable(getattr(LoadFileScheduling, "_assign_work_unit", None)):
        raise pytest.UsageError(f"pytest-xdist {xdist.__version__}'s LoadFileScheduling has no _assign_work_unit, which "
                                "tests/conftest.py's file order overrides: install requirements-test.txt's pin, or "
                                "port OrderedFileScheduling to this release")

    class OrderedFileScheduling(LoadFileScheduling):
        def _assign_work_unit(self, node):
            if not getattr(self, "_in_collection_order", False) and self.collection is not None:
                first: dict[str, int] = {}
                for nodeid in self.collection:
                    first.setdefault(self._split_scope(nodeid), len(first))
                for scope in sorted(self.workqueue, key=lambda s: first.get(s, len(first))):
                    self.workqueue.move_to_end(scope)
                self._in_collection_order = True
            super()._assign_work_unit(node)

    return OrderedFileScheduling(config, log)
