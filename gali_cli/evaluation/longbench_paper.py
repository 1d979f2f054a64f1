"""The GALI paper's LongBench numbers (Table "Performance comparison on LongBench", Llama-3-8B-Instruct), so that
`gali eval longbench` can print them beside ours when it runs the paper's model at the paper's lengths.

Rows are the paper's, × 100 as printed, over the 16 English datasets (longbench.PAPER_DATASETS). The "4k" backbone is
Llama-3-8B-Instruct with max_position_embeddings set to 4096 (gali's --train-len 4096); "16k" is 16 × 1024 tokens.
Rows the paper took from the SelfExtend paper (its blue asterisk) are `reported`; where it gives both, the authors'
own run comes first.
"""
# ruff: noqa: E501 - one row of the paper's table a line

from dataclasses import dataclass

from .longbench import PAPER_DATASETS


@dataclass(frozen=True)
class Row:
    train_len: int  # the backbone's window: 4096 (max_position_embeddings cut) or 8192
    length: int  # the window the method extends to
    method: str  # gali's method name
    scores: tuple[float, ...]  # one per PAPER_DATASETS, × 100
    average: float
    reported: bool = False  # taken from the SelfExtend paper (Jin et al. 2024), not run by the GALI authors


ROWS = (
    Row(4096, 16384, "original", (17.83, 40.62, 47.02, 40.97, 35.15, 20.99, 27.76, 19.70, 24.62, 71.00, 89.54, 42.31, 6.00, 23.50, 56.96, 49.06), 38.31),
    Row(4096, 16384, "self-extend", (23.34, 44.59, 51.22, 44.91, 37.43, 29.50, 28.52, 22.14, 24.34, 75.50, 90.71, 42.58, 7.50, 92.50, 54.99, 50.83), 45.04),
    Row(4096, 16384, "chunk-llama", (20.91, 40.15, 49.87, 47.71, 40.80, 28.75, 30.37, 21.81, 24.32, 74.50, 90.29, 41.78, 2.50, 56.75, 58.99, 57.55), 42.94),
    Row(4096, 16384, "ntk", (22.59, 46.25, 53.21, 51.91, 37.51, 26.56, 30.69, 22.74, 24.03, 73.50, 90.46, 42.20, 11.50, 73.00, 34.53, 36.39), 42.32),
    Row(4096, 16384, "dynamic-ntk", (18.65, 44.91, 51.37, 46.28, 37.57, 28.03, 30.20, 21.53, 24.48, 76.00, 89.11, 42.88, 9.00, 74.50, 53.91, 32.65), 42.57),
    Row(4096, 16384, "yarn", (16.43, 40.13, 53.04, 45.93, 33.66, 28.51, 30.40, 22.42, 23.24, 75.50, 91.04, 44.53, 6.50, 86.50, 43.26, 48.26), 43.08),
    Row(4096, 16384, "gali", (24.69, 45.26, 51.78, 51.33, 37.16, 30.79, 29.28, 22.65, 24.63, 77.00, 91.61, 42.92, 9.00, 95.50, 56.84, 49.04), 46.22),
    Row(8192, 16384, "original", (21.71, 44.24, 44.54, 46.82, 36.42, 21.49, 30.03, 22.67, 27.79, 74.50, 90.23, 42.53, 0.00, 67.00, 57.00, 51.22), 42.39, reported=True),
    Row(8192, 16384, "self-extend", (21.50, 43.96, 50.26, 48.18, 28.18, 25.58, 34.88, 23.83, 26.96, 75.50, 88.26, 42.01, 4.12, 88.00, 36.58, 37.73), 42.22, reported=True),
    Row(8192, 16384, "chunk-llama", (23.87, 43.86, 46.97, 49.37, 35.34, 26.52, 31.06, 21.99, 24.45, 76.00, 90.73, 42.29, 7.00, 72.00, 59.93, 56.98), 44.27),
    Row(8192, 16384, "ntk", (8.04, 43.85, 47.94, 20.44, 34.32, 1.57, 24.31, 13.22, 24.12, 74.50, 52.18, 33.12, 4.50, 45.50, 46.84, 38.71), 32.07),
    Row(8192, 16384, "dynamic-ntk", (8.19, 43.31, 47.91, 34.63, 35.26, 7.92, 26.83, 17.85, 24.51, 76.50, 71.72, 39.15, 5.67, 83.50, 56.58, 46.39), 39.12),
    Row(8192, 16384, "yarn", (12.39, 42.60, 51.70, 40.06, 35.03, 12.81, 30.30, 22.56, 23.51, 75.50, 82.99, 42.31, 6.50, 89.00, 50.51, 51.58), 41.83),
    Row(8192, 16384, "gali", (25.88, 45.65, 47.09, 51.07, 37.42, 28.75, 30.09, 22.70, 24.58, 77.00, 90.91, 42.43, 6.00, 83.00, 57.04, 53.06), 45.17),
    Row(8192, 32768, "original", (21.71, 44.24, 44.54, 46.82, 36.42, 21.49, 30.03, 22.67, 27.79, 74.50, 90.23, 42.53, 0.00, 67.00, 57.00, 51.22), 42.39, reported=True),
    Row(8192, 32768, "self-extend", (12.04, 12.10, 20.15, 8.22, 9.68, 3.89, 27.90, 14.58, 22.13, 61.00, 82.82, 1.40, 2.37, 2.83, 57.87, 56.42), 24.71, reported=True),
    Row(8192, 32768, "self-extend", (26.27, 44.23, 50.19, 48.28, 38.29, 29.19, 29.24, 22.68, 24.59, 76.00, 90.16, 42.45, 8.00, 88.00, 57.47, 49.51), 45.28),
    Row(8192, 32768, "chunk-llama", (24.48, 42.37, 47.05, 48.79, 34.53, 26.94, 32.08, 23.40, 24.36, 76.00, 90.46, 42.08, 6.50, 72.00, 59.52, 60.54), 44.44),
    Row(8192, 32768, "ntk", (7.31, 45.11, 53.18, 52.31, 37.70, 27.37, 29.37, 21.45, 23.69, 73.50, 78.25, 41.83, 9.00, 69.00, 34.25, 36.12), 39.97),
    Row(8192, 32768, "dynamic-ntk", (23.06, 43.95, 48.55, 52.68, 37.46, 25.22, 31.53, 22.19, 24.52, 77.00, 90.96, 42.42, 8.00, 71.50, 56.77, 43.78), 43.72),
    Row(8192, 32768, "yarn", (17.09, 40.90, 52.51, 46.40, 33.92, 29.47, 29.93, 22.69, 23.11, 75.00, 91.29, 42.54, 5.50, 89.50, 46.50, 51.38), 43.61),
    Row(8192, 32768, "gali", (28.63, 45.66, 47.23, 51.07, 38.35, 29.00, 29.98, 22.79, 24.59, 77.00, 91.13, 42.38, 5.50, 83.00, 57.07, 52.63), 45.38),
)

# Llama-3-8B's shape, which its Instruct version shares (Llama-3.1 differs in max_position_embeddings).
_LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "max_position_embeddings": 8192}


def is_paper_model(config, name: str) -> bool:
    """Whether a loaded model is the paper's, Llama-3-8B-Instruct: its config has Llama-3-8B's shape and its name
    (the path or hub id the user gave) says Instruct; the config alone cannot tell the base model from it."""
    shape = all(getattr(config, key, None) == value for key, value in _LLAMA3_8B.items())
    return shape and "instruct" in name.lower()


def paper_scores(train_len: int, length: int, method: str) -> dict[str, float] | None:
    """The paper's scores (× 100) per dataset and "average" for a method run within `train_len` and extended to
    `length` tokens; None where the paper has no such row. The authors' own run is preferred over a reported one."""
    rows = sorted((row for row in ROWS if (row.train_len, row.length, row.method) == (train_len, length, method)),
                  key=lambda row: row.reported)
    if not rows:
        return None
    return {**dict(zip(PAPER_DATASETS, rows[0].scores)), "average": rows[0].average}
