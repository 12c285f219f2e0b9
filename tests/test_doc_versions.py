"""Versions written in the docs agree with the locks.

Every "<component> <version>" in docs/*.md and README.md, where the component is one the locks pin
(configs/upstream.lock.toml, configs/upstream.cuda.lock.toml), must name a version or tag one of the
locks gives it (or a prefix of one: "verl 0.4.x"). Two-column table rows ("| name | version |",
and "| a, b | 1, 2 |" or "| a / b | 1 / 2 |") count too. Versions that are deliberately not ours,
the reference's and the benchmark machines' own, are listed below with the reason.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers import REPO
from verl_patches.core.lock import CUDA_LOCK_PATH, LOCK_PATH, load_lock

# How the docs name each locked component -> its key in the locks.
ALIASES = {
    "verl": "verl", "vLLM": "vllm", "vllm": "vllm", "vLLM-Ascend": "vllm_ascend", "vllm-ascend": "vllm_ascend",
    "vllm_ascend": "vllm_ascend", "megatron-core": "megatron_core", "megatron_core": "megatron_core",
    "Megatron": "megatron_core", "MindSpeed": "mindspeed", "mindspeed": "mindspeed", "MindSpeed-LLM": "mindspeed_llm",
    "mindspeed_llm": "mindspeed_llm", "torch": "torch",
    "torch-npu": "torch_npu", "torch_npu": "torch_npu", "CANN": "cann", "transformers": "transformers",
    "numpy": "numpy", "Ray": "ray", "ray": "ray", "Hydra": "hydra_core", "hydra-core": "hydra_core",
    "tensorboard": "tensorboard", "matplotlib": "matplotlib", "torch_memory_saver": "torch_memory_saver",
    "torch-memory-saver": "torch_memory_saver", "torchvision": "torchvision", "torchaudio": "torchaudio",
    "xformers": "xformers", "flash-attn": "flash_attn", "Transformer Engine": "transformer_engine",
    "transformer-engine": "transformer_engine",
}
VERSION = r"v?(\d+(?:\.\d+)*(?:\.?(?:post|rc|RC)\d+)?)"
NAME = "|".join(sorted(map(re.escape, ALIASES), key=len, reverse=True))
INLINE = re.compile(rf"(?<![\w./-])`?({NAME})`?(?![\w-])(?: |==)" + VERSION + r"(?![\w.])")
# (doc, name as written, version): why the doc names a version the locks do not pin.
NOT_OURS = {
    ("docs/RECIPE.md", "vLLM-Ascend", "0.9.1rc2"): "the reference's vLLM-Ascend",
    ("docs/RECIPE.md", "MindSpeed", "2.0.0"): "the reference's MindSpeed",
    ("docs/RECIPE.md", "MindSpeed", "2.1.0"): "the MindSpeed release locked before 2.2.0, where a row's reason changed with the move",
    ("docs/RECIPE.md", "megatron-core", "0.8"): "the reference's Megatron (core_r0.8.0)",
    ("docs/PERFORMANCE.md", "torch", "2.11"): "the benchmark machines' own torch",
    ("docs/GRAPH_MODE.md", "torch", "2.11"): "the H100 machine's own torch, where the backend was checked",
    ("docs/benchmarks.md", "torch", "2.11.0"): "the benchmark machines' own torch",
    ("docs/benchmarks.md", "transformers", "5.17"): "the H100 machine's own transformers",
    ("docs/TINY_RUN.md", "numpy", "2"): "the numpy release that breaks megatron-core 0.12.1's checkpoint save",
}


def accepted() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in (LOCK_PATH, CUDA_LOCK_PATH):
        for key, comp in load_lock(path).items():
            seen = out.setdefault(key, set())
            for v in (comp.version, comp.ref):
                if v:
                    seen.add(v.removeprefix("v"))
                    seen.update(re.findall(r"\d+(?:\.\d+)+(?:\.?(?:post|rc|RC)\d+)?", v))  # v2.1.0_core_r0.12.1
    return out


def mentions(text: str):
    """(line number, name as written, version) of every component version the text states."""
    for n, line in enumerate(text.splitlines(), 1):
        for m in INLINE.finditer(line):
            yield n, m.group(1), m.group(2)
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if len(cells) >= 2:
            for sep in (" / ", ", "):
                names = [x.strip("` ") for x in cells[0].split(sep)]
                if all(x in ALIASES for x in names):
                    versions = cells[1].split(sep)
                    for name, v in zip(names, versions):
                        m = re.match(VERSION + r"(?![\w.])", v.strip())
                        if m:
                            yield n, name, m.group(1)
                    break


def docs():
    return sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]


@pytest.mark.parametrize("doc", docs(), ids=lambda p: p.name)
def test_versions_in_docs_are_the_locks(doc):
    ok = accepted()
    rel = doc.relative_to(REPO).as_posix()
    wrong = []
    for n, name, version in mentions(doc.read_text()):
        allowed = ok[ALIASES[name]]
        if version in allowed or any(a.startswith(version + ".") for a in allowed):
            continue
        if (rel, name, version) in NOT_OURS:
            continue
        wrong.append(f"{rel}:{n}: {name} {version} (the locks: {sorted(allowed)})")
    assert not wrong, "versions the locks do not pin:\n" + "\n".join(wrong)


def test_the_scan_finds_what_it_should():
    found = set((name, v) for _, name, v in mentions(
        "torch 2.5.1 and `torch_memory_saver` 0.0.10\n| torch_memory_saver | 0.0.8, optional |\n"
        "| verl, megatron-core | 0.4.1, 0.12.1 | x |\n| torch / torchvision | 2.7.0 / 0.22.0 | y |\nvllm==0.9.1"))
    assert found == {("torch", "2.5.1"), ("torch_memory_saver", "0.0.10"), ("torch_memory_saver", "0.0.8"),
                     ("verl", "0.4.1"), ("megatron-core", "0.12.1"), ("torch", "2.7.0"), ("torchvision", "0.22.0"),
                     ("vllm", "0.9.1")}
    assert "0.0.8" not in accepted()["torch_memory_saver"]
