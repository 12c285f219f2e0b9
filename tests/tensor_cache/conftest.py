"""Put this folder on sys.path so spawned ranks can import the rank functions (tc_workers)."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
