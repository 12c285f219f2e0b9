"""The embedded default: the recipe's loop on a 4-layer DeepSeek-V3 on one machine (``scripts/train_tiny.sh``).

``assets`` writes the model directory (config + a character tokenizer) and the data (a toy task a
tiny model can learn, and the shipped deepscaler sample for validation); ``reward`` scores both;
``upstream`` copies the installed verl with the prelude line, for a run that must not edit the installed one.
The run's report is the recipe's (verl_patches/reporting/report.py).
"""
