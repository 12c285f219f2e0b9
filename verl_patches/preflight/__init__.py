"""The preflight, the main job (docs/PREFLIGHT.md): whole train/rollout switches rehearsed on real process groups
and every shard verified. ``cli`` (``python -m verl_patches preflight``), ``switch_rehearsal`` (one rank's
rehearsal of the switch), ``values`` (seeded values for any slice: the ground truth), ``hf_check`` (full models
rebuilt from the shards and compared in transformers) and ``graph_check`` (a captured CUDA graph replayed after
every switch).
"""
