"""The hand-written kernels: the native C sources (one a kernel, built together into one library on first use) and
their loader, the C decoding step, and the Triton kernels (imported only when they run); plus what choosing them
depends on outside torch."""
