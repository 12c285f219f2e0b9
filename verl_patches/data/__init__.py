"""Data preparation for the recipe: raw math data sets to verl's RL parquet schema.

Entry point: ``python -m verl_patches.data.prepare``.
"""
