"""CPU-platform patches of verl 0.4.1: one module per verl module patched."""
