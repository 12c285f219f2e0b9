"""The launch-time checks and commands, the commands' floor (below the rigs only): ``recipe_config`` (the run
configs composed against the installed verl and checked: ``python -m verl_patches.checks.recipe_config``),
``compose`` (a config composed as verl's main_ppo composes it), ``recipe_memory`` (a layout's memory per device,
and the checkpoint's size),
``data_check`` (the data files a run reads: ``python -m verl_patches.checks.data_check``) and ``layer_spec`` (the
classes an Ascend rank builds: ``python -m verl_patches layer-spec``). No module of the package imports them but
each other. Importing this package imports none of its modules.
"""
