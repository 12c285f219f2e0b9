"""Write what the tiny run needs, deterministically and offline: a model directory and two parquet files.

- ``model/``: ``configs/model/tiny_deepseek_v3.json`` (a 4-layer DeepSeek-V3: MLA, 1 dense + 3 MoE
  layers of 16 routed experts in 4 groups, sigmoid router with expert bias), seeded random BF16
  weights written by transformers' DeepseekV3 (safetensors), and a character-level tokenizer of
  exactly the model's vocabulary (special tokens, printable characters, the digit pairs 00-99,
  then letter pairs and triples as fillers) with a plain chat template.
- ``dist_ckpt/``: those weights converted by the recipe's own converter
  (python -m verl_patches.tools.hf_to_mcore) to a Megatron distributed checkpoint in the tiny
  run's training layout; actor and reference load it, as the real-weight run loads DIST_CKPT_PATH.
  Its names follow the layer spec the run's model is built from (``--spec``): ``te`` (verl's
  Transformer-Engine spec: the CPU and CUDA runs) or ``mindspeed_llm`` (MindSpeed-LLM's DeepSeek spec:
  the NPU path, and the default on the NPU rehearsal platform, VERL_PATCHES_PLATFORM=npu-rehearsal).
  A build is for one spec (its index records it); another spec needs another directory.
- ``data/train.parquet``: the toy task (``TOY_SOURCE``): "write digits" prompts, scored by the share of
  digits in the answer (verl_patches/rigs/tiny/reward.py). A random tiny model writes ~10% digits; GRPO
  raises it within a few steps.
- ``data/val.parquet``: the shipped deepscaler sample (data/sample), prepared as the recipe prepares
  deepscaler, scored by the recipe's rule reward through verl's reward manager.

``python -m verl_patches.rigs.tiny.assets OUT_DIR [--spec te|mindspeed_llm]`` (prints the paths as shell assignments).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import random
import shutil
import string
import sys
from pathlib import Path

from verl_patches.core.lock import REPO_ROOT
from verl_patches.base import atomic
from verl_patches.base.schema import PathArg
from verl_patches.data.prepare import SAMPLES, load_examples, to_record
from verl_patches.rigs.npu_rehearsal.platform import selected as rehearsal_selected
from verl_patches.tools import hf_to_mcore
from verl_patches.tools.manifest import file_record
import torch

MODEL_CONFIG = REPO_ROOT / "configs" / "model" / "tiny_deepseek_v3.json"
TOY_SOURCE = "tiny_digits"
SPECIAL = ("<bos>", "<eos>", "<pad>", "<unk>")
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
TOY_PROMPTS = 64
TINY_CONFIG = REPO_ROOT / "configs" / "tiny_deepseek_v3.yaml"
WEIGHT_SEED = 1234


def vocabulary(size: int) -> list[str]:
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    pairs = [f"{i:02d}" for i in range(100)]
    letters = string.ascii_lowercase
    fillers = ("".join(t) for n in (2, 3) for t in itertools.product(letters, repeat=n))
    vocab = list(SPECIAL) + chars + pairs
    for tok in fillers:
        if len(vocab) >= size:
            break
        if tok not in vocab:
            vocab.append(tok)
    if len(vocab) != size:
        raise ValueError(f"cannot build a vocabulary of {size} tokens")
    return vocab


def write_model(out: Path) -> Path:
    # Lazy: tokenizers, transformers and OmegaConf only when the tiny assets are written.
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads(MODEL_CONFIG.read_text())
    vocab = {tok: i for i, tok in enumerate(vocabulary(cfg["vocab_size"]))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    cfg.update(bos_token_id=vocab["<bos>"], eos_token_id=vocab["<eos>"], pad_token_id=vocab["<pad>"])
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": vocab["<bos>"], "eos_token_id": vocab["<eos>"], "pad_token_id": vocab["<pad>"]}) + "\n")
    return out


def write_weights(model_dir: Path, seed: int = WEIGHT_SEED) -> Path:
    """Seeded random BF16 weights in HF's DeepseekV3 layout (what a released checkpoint holds)."""
    # Lazy: tokenizers, transformers and OmegaConf only when the tiny assets are written.
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = json.loads((model_dir / "config.json").read_text())
    config = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)
    # save_pretrained rewrites config.json in transformers' own form; keep ours (it is what vLLM reads).
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    return model_dir


def training_layout() -> dict:
    """The tiny run's training layout, from its YAML (the converter chunks the checkpoint by it;
    megatron's loader reshards to any layout)."""
    # Lazy: tokenizers, transformers and OmegaConf only when the tiny assets are written.
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(TINY_CONFIG)
    meg = cfg.actor_rollout_ref.actor.megatron
    return {"tp": meg.tensor_model_parallel_size, "pp": meg.pipeline_model_parallel_size,
            "ep": meg.expert_model_parallel_size,
            "layers": list(cfg.actor_rollout_ref.rollout.recipe.megatron.num_layer_list)}


SPECS = ("te", "mindspeed_llm")  # the layer specs the tiny run's models are built from


def default_spec() -> str:
    """The layer spec of this platform's training model: MindSpeed-LLM's DeepSeek spec on the NPU rehearsal
    platform (verl_patches/rigs/npu_rehearsal/platform.py), the Transformer-Engine names elsewhere."""
    return "mindspeed_llm" if rehearsal_selected() else "te"


def write_checkpoint(model_dir: Path, out: Path, spec: str = "te") -> Path:
    lay = training_layout()
    argv = ["--hf", str(model_dir), "--out", str(out), "--tp", str(lay["tp"]), "--pp", str(lay["pp"]),
            "--ep", str(lay["ep"]), "--num-layer-list", ",".join(map(str, lay["layers"])), "--spec", spec,
            "--no-progress"]

    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        rc = hf_to_mcore.main(argv)
    if rc != 0:
        raise RuntimeError(f"hf_to_mcore {' '.join(argv)} failed:\n{log.getvalue()}")
    return out


def toy_records(n: int = TOY_PROMPTS, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = ["digits", "numbers", "figures"]
    rows = []
    for i in range(n):
        example = " ".join(str(rng.randrange(10)) for _ in range(3))
        rows.append({
            "data_source": TOY_SOURCE,
            "prompt": [{"role": "user", "content": f"Write {words[i % 3]}, like {example}."}],
            "ability": "toy",
            "reward_model": {"style": "rule", "ground_truth": "digits"},
            "extra_info": {"split": "train", "index": i},
        })
    return rows


def write_parquet(records: list[dict], path: Path) -> None:
    # pyarrow directly (not pandas): the nested schema and the bytes are the same on every run.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), str(path))


def write_data(out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    train, val = out / "train.parquet", out / "val.parquet"
    write_parquet(toy_records(), train)
    examples, _ = load_examples("deepscaler", SAMPLES["deepscaler"])
    write_parquet([to_record(ex, "test", i, "deepscaler") for i, ex in enumerate(examples)], val)
    return train, val


def _index(out_dir: Path, parts: tuple[str, ...]) -> dict[str, dict]:
    return {str(f.relative_to(out_dir)): file_record(f) for p in parts for f in sorted((out_dir / p).rglob("*"))
            if f.is_file()}


def _changed(out_dir: Path, done: Path, parts: tuple[str, ...]) -> list[str]:
    """One line per file of the finished build that is missing, new or other than written (the index, .complete,
    lists them by size and SHA-256); an index that cannot be read is one line too."""
    try:
        want = json.loads(done.read_text())["files"]
        if not isinstance(want, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        return [f"its index {done.name} is not readable (written by an older version, or damaged)"]
    have = _index(out_dir, parts)
    return ([f"{k} is missing" for k in sorted(set(want) - set(have))]
            + [f"{k} was not written by the build" for k in sorted(set(have) - set(want))]
            + [f"{k} differs from what was written" for k in sorted(set(want) & set(have)) if want[k] != have[k]])


class AssetsError(RuntimeError):
    """The output directory holds something this tool did not write."""


def build(out_dir: Path, spec: str | None = None) -> dict[str, Path]:
    """Everything, built once: written under ``out_dir/.partial`` and moved in whole, so a finished
    build is reused by later runs and tests, and an interrupted one never passes for finished. Two builds
    into one directory at once are serialised: the second waits for the first's lock, then reuses its build.
    ``spec``: the checkpoint's layer spec (default: default_spec()); a finished build for another is refused."""
    spec = default_spec() if spec is None else spec
    if spec not in SPECS:
        raise AssetsError(f"layer spec {spec!r}: expected one of {', '.join(SPECS)}")
    out_dir = Path(out_dir)
    with atomic.dir_lock(out_dir, wait=True):  # a second build into the same place waits, then reuses it
        return _build(out_dir, spec)


def _built_spec(done: Path) -> str | None:
    """The layer spec a finished build's index records ("te" for an index from before specs were recorded)."""
    try:
        index = json.loads(done.read_text())
    except (OSError, ValueError):
        return None  # _changed names it
    return index.get("spec", "te") if isinstance(index, dict) else None


def _build(out_dir: Path, spec: str = "te") -> dict[str, Path]:
    done = out_dir / ".complete"
    parts = ("model", "dist_ckpt", "data")
    if not done.is_file():
        foreign = [p for p in parts if (out_dir / p).exists()]
        if foreign:
            raise AssetsError(f"{out_dir} holds {foreign} but no finished build of this tool: choose another "
                              "directory, or remove those yourself")
        partial = out_dir / ".partial"
        shutil.rmtree(partial, ignore_errors=True)  # ours: only this tool writes there
        write_model(partial / "model")
        write_weights(partial / "model")
        write_checkpoint(partial / "model", partial / "dist_ckpt", spec)
        write_data(partial / "data")
        for p in parts:
            (partial / p).rename(out_dir / p)
        shutil.rmtree(partial)  # and the converter's lock file beside dist_ckpt

        # The index, written last: what the build wrote, by content; a later run reuses the build only
        # when every file still has it.
        index = {"tool": "python -m verl_patches.rigs.tiny.assets", "files": _index(out_dir, parts)}
        if spec != "te":  # a te build's index stays as it was before specs were recorded
            index["spec"] = spec
        atomic.write_text(done, json.dumps(index, indent=1, sort_keys=True) + "\n")
    else:
        built = _built_spec(done)
        if built is not None and built != spec:
            raise AssetsError(f"{out_dir} holds a build whose checkpoint follows the {built!r} layer spec; this run's "
                              f"model needs {spec!r}: give another directory (TINY_ASSETS) for it")
        changed = _changed(out_dir, done, parts)
        if changed:
            raise AssetsError(f"{out_dir} holds a build of this tool that changed since it was written ("
                              + "; ".join(changed[:5]) + (" ..." if len(changed) > 5 else "")
                              + f"): remove {out_dir} and run again to rebuild it")
    return {"MODEL_PATH": out_dir / "model", "DIST_CKPT_PATH": out_dir / "dist_ckpt",
            "TRAIN_FILES": out_dir / "data" / "train.parquet", "VAL_FILES": out_dir / "data" / "val.parquet"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_patches.rigs.tiny.assets", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=PathArg("output directory"))
    p.add_argument("--spec", choices=SPECS, default=None,
                   help="the checkpoint's layer spec: te (verl's Transformer-Engine names) or mindspeed_llm "
                        "(MindSpeed-LLM's DeepSeek spec, the NPU path); default: mindspeed_llm on the NPU rehearsal "
                        "platform, te elsewhere")
    args = p.parse_args(argv)
    try:
        paths = build(args.out_dir, args.spec)
    except AssetsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        # Unwritable, full disk: no .complete is written, so nothing passes for a finished build.
        where = e.filename or args.out_dir
        print(f"error: {args.out_dir}: cannot write the assets ({where}: {e.strerror or e})", file=sys.stderr)
        return 2
    for key, path in paths.items():
        print(f"{key}={path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
