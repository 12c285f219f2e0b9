"""Data preparation for the recipe: raw math data sets to verl's RL parquet schema.

Entry point: ``python -m verl_patches.data.prepare``; the prepared files are checked by
``python -m verl_patches.checks.data_check``.
"""
