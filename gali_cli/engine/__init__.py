"""The engine: position-remapping attention on tensors, and its hooks into a transformers Llama.

One concern a file, dependencies pointing down the list:

- positions.py: GALI's chunks and positions (Algorithms 1-2), plain functions of integers.
- noise.py: the counter-based Gaussian noise, a pure function of (seed, layer, row, head, query, key).
- rope.py: the model's cos/sin tables, rotations, GALI's interpolated key rotations.
- dense.py: causal attention shared by every method (SDPA routes, explicit logits a tile at a time).
- noisy_attention.py: GALI's logit noise and its two paths (PyTorch or the fused kernel), chosen by $GALI_KERNEL.
- triton_attention.py: the fused Triton kernel (imported only when it runs).
- gali_attention.py: GALI's prefill attention, chunk by chunk (Algorithm 3).
- decode.py: GALI's one-token decoding without re-rotating the cache.
- seam.py: how the installed transformers takes the KV cache; SeamError when it is not a way gali knows.
- hooks.py: the transformers extension points every position-remapping method is installed through.
- reference.py, reference_model.py: the oracles (Alg. 3 as written; a float64 Llama with each method's positions).
"""
