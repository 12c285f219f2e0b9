"""Processes: what each process applies at its start, the local ranks of the preflight and the tests, and the
cluster launchers' checks.

``prelude`` (``apply_prelude``: the patches of the process's phase, which the entry modules run), ``local_ranks``
(``run_distributed``: a function on N local processes joined by torch.distributed), ``rank_boot`` (the first code
such a rank runs: its heartbeat), ``rank_preload`` (what the ranks' forkserver imports once), ``procs`` (process
lifetimes: children die with their parent; ``python -m verl_patches.launch.procs exec -- CMD``), ``node_watch``
(the head launcher's watch on every node), ``netns_cluster`` (several nodes on one machine in network namespaces) and
``cluster_checks`` (the cluster launchers' checks of their inputs: ``python -m verl_patches.launch.cluster_checks``).
Importing this package imports none of its modules.
"""
