"""The engine's math, plain functions of integers and tensors with no model in sight: GALI's chunks and positions
(Algorithms 1-2), the model's rotation tables, the counter-based noise, and the merging of partial softmaxes."""
