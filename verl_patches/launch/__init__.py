"""Processes: the local ranks of the preflight and the tests, and the cluster launchers' checks.

``local_ranks`` (``run_distributed``: a function on N local processes joined by torch.distributed),
``rank_boot`` (the first code such a rank runs: its heartbeat), ``rank_preload`` (what the ranks'
forkserver imports once), ``procs`` (process lifetimes: children die with their parent;
``python -m verl_patches.launch.local_ranks.procs exec -- CMD``), ``ports`` (rendezvous ports) and ``cluster_checks``
(the cluster launchers' checks of their inputs: ``python -m verl_patches.launch.local_ranks.cluster_checks``).
Importing this package imports none of its modules.
"""
