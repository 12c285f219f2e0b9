"""Rule rewards for the recipe's data sets (docs/DESIGN.md section 7).

``deepscaler`` (the rule reward and the data sources it scores) and ``_verify_worker`` (its math-verify helper
process). Plain functions with verl's custom-reward signature; nothing here patches verl.
"""

# data_source values the deepscaler preparation tool writes (verl_patches/data/prepare.py), plus the dataset's
# hub name: the rows verl_patches.reward.deepscaler scores (the reward patch routes them there).
DEEPSCALER_SOURCES = frozenset({"deepscaler", "agentica-org/DeepScaleR-Preview-Dataset"})
