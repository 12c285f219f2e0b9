"""TensorCache (docs/DESIGN.md section 5): stage outputs stay on the device between training stages
and move between data-parallel layouts by one all-to-all. Plain torch; importing patches nothing.
"""

from verl_patches.tensor_cache.cache import CacheError, TensorCache, process_cache
from verl_patches.tensor_cache.exchange import MoveStats, apply_plan, gather_layouts, relayout
from verl_patches.tensor_cache.layout import (ExchangePlan, LayoutError, generation_rows, megatron_dp_rows,
                                              plan_exchange)

__all__ = [
    "CacheError", "ExchangePlan", "LayoutError", "MoveStats", "TensorCache", "apply_plan", "gather_layouts",
    "generation_rows", "megatron_dp_rows", "plan_exchange", "process_cache", "relayout",
]
