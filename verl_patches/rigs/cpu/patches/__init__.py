"""The CPU platform's patch records (every one ``platforms=("cpu",)``), one folder per upstream package
as beside them: what lets the recipe's loop run on a host with no accelerator (the tiny run in CI, a
laptop). The stand-ins they install live in verl_patches/rigs/cpu/; nothing here applies on NPU or CUDA.

The catalogue lists these modules after the recipe's (verl_patches/patches/__init__.py: CPU_MODULES);
the prelude applies them first.
"""
