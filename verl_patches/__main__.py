"""``python -m verl_patches ...``: see verl_patches/cli.py."""

import sys

from verl_patches.cli import main

sys.exit(main())
