"""The training side's features, framework-free (plain torch; the patch modules under verl_patches/patches/
bind them to megatron-core and verl): megatron-core's data-parallel communication overlap as the recipe turns
it on (``ddp_overlap``), the rollout-vs-train mismatch and entropy measured inside the update (``mismatch``),
fixed (balanced) expert routing for the random-init benchmark (``fixed_routing``: the training router's
and, through the environment, the rollout's), the old log-prob reuse's context inside the update
(``old_log_prob``), the uneven pipeline layer list as megatron-core's config carries it (``layer_list``), the
classes a layer spec resolves to and what is wrong with any of them (``layer_classes``), the order a step's
checkpoint is committed in and what a resume accepts (``checkpoint_commit``) and MindSpeed-LLM's adaptor at an
Ascend rank's start (``mindspeed_adaptor``).
"""
