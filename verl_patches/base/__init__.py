"""The floor every part stands on: the accelerator facade (``accelerator``: npu, cuda or cpu, resolved at
call time) and outputs that are complete or absent (``atomic``). Importing this package imports none of
its modules.
"""
