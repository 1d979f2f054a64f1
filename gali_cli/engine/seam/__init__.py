"""The seam with transformers: how the installed release's forward takes its KV cache and what it refuses
(cache_argument.py, SeamError), the hooks a method is installed through (hooks.py), the KV cache that appends in place
(kv_cache.py), the static decoding step and its layers (static_decode.py, static_layers.py), and its projections, on
the CPU as byte grids where a GGUF's weights lie on them (projections.py, grid_weights.py, packed_modules.py).
"""
