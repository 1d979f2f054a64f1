"""The attention routes (dense, noisy, GALI's chunks, its decoding, the windowed split, the kept rotated keys) and
the one place that chooses among them for a forward (`choice.plan_for`, giving a `plan.AttentionPlan`)."""
