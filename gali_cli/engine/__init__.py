"""The engine: position-remapping attention on tensors, and its hooks into a transformers Llama.

One concern a file, dependencies pointing down the list:

- positions.py: GALI's chunks and positions (Algorithms 1-2), plain functions of integers.
- noise.py: the counter-based Gaussian noise, a pure function of (seed, layer, row, head, query, key).
- rope.py: the model's cos/sin tables, rotations, GALI's interpolated key rotations.
- kernel_choice.py: $GALI_KERNEL, whether triton is installed, the C compiler (no torch).
- plan.py: which attention a forward takes (AttentionPlan): decided once per forward, followed by every layer,
  described for `gali info` (its decision needs no torch).
- dense.py: causal attention shared by every method (SDPA routes, explicit logits a tile at a time), and partial
  attentions with their log-sum-exps.
- noisy_attention.py: GALI's logit noise, its three paths (PyTorch, the fused kernel, the native CPU kernel) and the
  kernels' first-use checks.
- triton_attention.py: the fused Triton kernel (imported only when it runs).
- native_noise.py, native_kernels.c: the CPU's native kernels (noise; decoding, called by native_decode.py), built
  on first use.
- gali_attention.py: GALI's prefill attention, chunk by chunk (Algorithm 3).
- kept_keys.py: rotated keys kept with the KV cache per layer, in the frame they were rotated for.
- decode.py: GALI's one-token decoding without re-rotating the cache.
- static_decode.py: the decoding step with static shapes (a CUDA graph on a GPU) and how it attends;
  triton_decode.py, native_decode.py: its attention as a kernel rotating each key as it reads it (GPU, CPU).
- grid_weights.py: its projections on the CPU held as a byte a weight, where they lie exactly on per-block grids
  (GGUF's formats), multiplied by native_kernels.c.
- windowed.py: attention split at a distance (SelfExtend, ReRoPE, Leaky ReRoPE, DPE).
- kv_cache.py: the KV cache gali generates with (a DynamicCache whose layers append in place).
- seam.py: how the installed transformers takes the KV cache; SeamError when it is not a way gali knows.
- hooks.py: the transformers extension points every position-remapping method is installed through.
- self_check.py: `gali info --check`'s checks of the fast paths.
- reference.py, reference_model.py: the oracles (Alg. 3 as written; a float64 Llama with each method's positions).
"""
