"""The hand-written kernels: the native C source and its loader (built on first use), the C decoding step, and the
Triton kernels (imported only when they run); plus what choosing them depends on outside torch."""
