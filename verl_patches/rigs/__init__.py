"""The rigs: what lets the recipe run and be tested without its accelerator, in one wing above the recipe.

- ``cpu/``: the CPU platform (CUDA's runtime on the host, Transformer Engine's layers, vLLM's engine and platform),
  with its patch records in ``cpu/patches/<upstream>/`` (every one ``platforms=("cpu",)``; the catalogue names
  them by string, ``verl_patches.patches.CPU_MODULES``);
- ``npu_rehearsal/``: the NPU rehearsal platform (``VERL_PATCHES_PLATFORM=npu-rehearsal``): the torch_npu,
  torchair and acl stand-ins under ``site/``, torch_npu's operators and MindSpeed's kernels on the host (``ops/``);
- ``tiny/``: the tiny run's assets (model directory, data, reward) and a copy of verl with the prelude line
  (``scripts/train_tiny.sh``);
- ``testing/``: the test helpers (live models, group checks, the pytest plugin that stops on SIGTERM).

No recipe module imports the rigs but through one door, ``npu_rehearsal`` (the platform's selection and
activation), imported by the modules that choose the process's platform: tests/test_import_graph.py pins it
(``RIG_DOOR_USERS``). This ``__init__`` imports nothing.
"""
