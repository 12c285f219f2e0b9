"""The embedded default: the recipe's loop on a 4-layer DeepSeek-V3 on one machine (``scripts/train_tiny.sh``).

``assets`` writes the model directory (config + a character tokenizer) and the data (a toy task a
tiny model can learn, and the shipped deepscaler sample for validation); ``reward`` scores both;
``report`` prints one line per step and the run's summary.
"""
