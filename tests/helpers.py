"""Small helpers shared by tests: run the overlay's CLI or a Python snippet in a subprocess."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


def run_py(code_or_args: str | list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
           timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -c CODE`` (str) or ``python ARGS`` (list) with the test environment's interpreter."""
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    full_env = dict(os.environ)
    full_env.setdefault("VLLM_PLUGINS", "verl_patches")
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(FIXTURES), str(REPO), *([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])])
    full_env.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env,
                          cwd=str(cwd or REPO), timeout=timeout)


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run_py(["-m", "verl_patches", *args], env=env, cwd=cwd)


def declared_ckpt(d: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    """A complete torch_dist checkpoint whose index declares ``shapes`` (global shapes, as Megatron's loader
    and the launchers' checker read them) and stores one element of each tensor: a 671B model's index in
    kilobytes. Its data covers only that element, so it is for the checks, not for loading."""
    import torch

    from verl_patches.tools.mcore_layout import UnitWriter, write_metadata

    d.mkdir(parents=True)
    w = UnitWriter(d / "model.distcp")
    for name, shape in shapes.items():
        ones = (1,) * len(shape)
        w.tensor(name, torch.zeros(ones), [((0,) * len(shape), ones)])
        C = w.C
        w.state_meta[name] = C["TensorMeta"](properties=C["Props"](dtype=torch.bfloat16), size=torch.Size(shape),
                                             chunks=w.state_meta[name].chunks)
    write_metadata(d, [w.close()])
    return d


def model_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """What the launchers' checker compares with a config.json: the embedding and one tensor per decoder layer."""
    h = cfg["hidden_size"]
    return {"embedding.word_embeddings.weight": (cfg["vocab_size"], h),
            **{f"decoder.layers.{i}.input_layernorm.weight": (h,) for i in range(cfg["num_hidden_layers"])}}


def head_inputs(root: Path) -> dict[str, str]:
    """MODEL_PATH (DeepSeek-V3's config.json) and one valid deepscaler data file, as the head needs them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = root / "DeepSeek-V3"
    model.mkdir(parents=True)
    (model / "config.json").write_text((REPO / "configs" / "model" / "deepseek_v3.json").read_text())
    data = root / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{
        "data_source": "deepscaler", "prompt": [{"role": "user", "content": "What is 1+1?"}], "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 0}}]), str(data))
    return {"MODEL_PATH": str(model), "TRAIN_FILES": str(data), "VAL_FILES": str(data)}


def rank_pids(parent: int) -> list[int]:
    """The ranks ``run_distributed`` started under process ``parent``: spawned interpreters
    (multiprocessing's spawn_main, not its resource tracker), or children of its forkserver
    (VERL_PATCHES_RANK_START=forkserver; the server itself is not a rank)."""
    from verl_patches.launch import procs

    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    def ppid(pid: int) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return -1

    out = []
    for pid in procs.descendants(parent):
        cmd = cmdline(pid)
        if b"resource_tracker" in cmd:
            continue
        if b"spawn_main" in cmd or b"multiprocessing.forkserver" in cmdline(ppid(pid)):
            out.append(pid)
    return out


def npu_stack_missing() -> str | None:
    """The first package of the NPU path that is not importable here (MindSpeed 2.2.0, MindSpeed-LLM 2.2.0,
    Megatron-LM's training package), or None."""
    for name in ("mindspeed_llm", "megatron.training", "mindspeed.te.pytorch.module"):
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ModuleNotFoundError:
            return name
    return None


needs_npu_stack = pytest.mark.skipif(npu_stack_missing() is not None,
                                     reason=f"{npu_stack_missing()} is not importable (MindSpeed v2.2.0_core_r0.12.1, "
                                            "MindSpeed-LLM v2.2.0 and Megatron-LM core_v0.12.1's training "
                                            "packages are needed: scripts/setup_test_env.sh installs them)")
