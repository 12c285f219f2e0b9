"""Configuration and settings: what a run is told and how it is checked.

``settings`` (the recipe section's keys, types and defaults, and their one reader).
Importing this package imports none of its modules.
"""
