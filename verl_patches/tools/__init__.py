"""Checkpoint tools for the recipe: FP8 to BF16, HF to Megatron distributed checkpoint, and back.

Each is a ``python -m verl_patches.tools.<name>`` entry point that streams, so 671B fits one node.
"""
