"""The ground every part stands on: the accelerator facade (``accelerator``: npu, cuda or cpu, resolved at call
time), the overlay's ``VERL_PATCHES_*`` environment variables and their one typed reader (``env``), the declared
rules of every command-line option (``schema``), outputs that are complete or absent (``atomic``), rendezvous
ports (``ports``) and profiles of chosen stages (``profile``). Importing this package imports none of its modules.
"""
