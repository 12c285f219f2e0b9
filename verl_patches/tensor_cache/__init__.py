"""TensorCache (docs/DESIGN.md section 5): stage outputs stay on the device between training stages
and move between data-parallel layouts by one all-to-all: ``cache`` (the per-process cache), ``layout`` (row
layouts and the exchange plan), ``exchange`` (the one all_to_all_single) and ``protocol`` (what the driver and the
workers agree on). Plain torch; importing patches nothing. Names are loaded on first use.
"""

from __future__ import annotations

from verl_patches import lazy_names

# Each name and the module it lives in: imported on first use (PEP 562), so that reading the patch
# catalogue (the doctor) needs no torch.
_WHERE = {
    **dict.fromkeys(['CacheError', 'TensorCache', 'process_cache'], 'verl_patches.tensor_cache.cache'),
    **dict.fromkeys(['MoveStats', 'apply_plan', 'gather_layouts', 'relayout'], 'verl_patches.tensor_cache.exchange'),
    **dict.fromkeys(['ExchangePlan', 'LayoutError', 'generation_rows', 'megatron_dp_rows', 'plan_exchange'], 'verl_patches.tensor_cache.layout'),
}

__all__, __getattr__, __dir__ = lazy_names(__name__, _WHERE)
