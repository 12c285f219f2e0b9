"""Checkpoint tools for the recipe: FP8 to BF16, HF to Megatron distributed checkpoint, and back.

``fp8_to_bf16``, ``hf_to_mcore`` and ``mcore_to_hf`` (the converters), ``check_ckpt`` (whether a directory is a
complete torch_dist checkpoint), ``mcore_layout`` (the names between HF and Megatron-core, the torch_dist format)
and ``manifest`` (who wrote an output directory, from what).

Each is a ``python -m verl_patches.tools.<name>`` entry point that streams, so 671B fits one node.
"""
