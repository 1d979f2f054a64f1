"""The engine: position-remapping attention on tensors, and its seam with a transformers Llama. In wings, dependencies
pointing down the list (tests/project/test_imports.py holds the package free of import circles):

- math/: GALI's chunks and positions (Algorithms 1-2), the model's rotation tables, the counter-based noise, and
  partial softmaxes merged by their log-sum-exps: plain functions of integers and tensors.
- kernels/: the native C sources, their loader (built on first use) and the C decoding step; the Triton kernels
  (imported only when they run); what choosing them depends on outside torch ($GALI_KERNEL, triton, the compiler).
- attention/: the routes (dense, noisy, GALI's chunks and decoding, kept rotated keys) and the one place
  that chooses among them for a forward (choice.plan_for -> plan.AttentionPlan).
- contract.py: what a method implements (PositionalAttention) and is handed (Forward, Placement, KeptKeys).
- seam/: how the installed transformers takes the KV cache, the hooks a method is installed through, the KV cache
  that appends in place, the static decoding step (a CUDA graph on a GPU) and its byte-grid projections.
- checks/: the oracles (Alg. 3 as written; a float64 Llama with each method's positions) and `gali info --check`.
"""
