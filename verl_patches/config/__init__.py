"""Configuration and settings: what a run is told, read once and checked before it starts.

``settings`` (the recipe section's keys, types and defaults, and their one reader), ``env`` (the overlay's
``VERL_PATCHES_*`` environment variables, their one typed reader), ``recipe_config`` (the run configs
composed against the installed verl and checked: ``python -m verl_patches.config.recipe_config``),
``recipe_memory`` (a layout's memory per device), ``megatron_args`` (``recipe.megatron`` mapped to
MindSpeed / Megatron) and ``optim_offload`` (``actor.optim``'s optimizer-offload settings).
Importing this package imports none of its modules.
"""
