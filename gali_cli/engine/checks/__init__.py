"""The oracles and self-checks: GALI's Algorithm 3 as written, a float64 Llama with each method's positions, and
`gali info --check`'s comparison of every fast path this device runs against them."""
