"""The recipe's settings, on the ground floor: ``settings`` (the recipe section's keys, types, defaults and rules,
the reshard methods' names, and their one reader), ``megatron_args`` (``recipe.megatron`` mapped to MindSpeed /
Megatron) and ``optim_offload`` (``actor.optim``'s optimizer-offload settings). The launch-time checks that read
them are a wing of their own (verl_patches/checks/). Importing this package imports none of its modules.
"""
