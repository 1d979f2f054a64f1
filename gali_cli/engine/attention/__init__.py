"""The attention routes (dense, noisy, GALI's chunks, its decoding, the kept rotated keys) and
the one place that chooses among them for a forward (`choice.plan_for`, giving a `plan.AttentionPlan`); beside it,
how the static decoding step attends over the cache and whether it is taken (`decode_route.py`)."""
