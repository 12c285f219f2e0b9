"""What a user reads: the run's report, its plots, the console, and the last lines of a checking command.

``report`` (one line per step, the JSONL record, the summary), ``switch_report`` (the switch's figures,
gathered on a generation worker), ``plot`` (the run's curves: ``python -m verl_patches plot``), ``console``
(the trainer's output into a log, the report's lines on the console:
``python -m verl_patches.reporting.console LOG``) and ``findings`` (what a checking command found, and its
exit code). Importing this package imports none of its modules.
"""
