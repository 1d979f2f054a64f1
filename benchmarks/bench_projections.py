"""The CPU decoding step's projections: gali's byte-grid product (engine/grid_weights.py, `gali_grid_matvec` in
native_grids.c) against torch's own weight-only kernels and plain F.linear, on a real model's weights.

    python benchmarks/bench_projections.py --model smollm2 --mode ops --rounds 15
    python benchmarks/bench_projections.py --model smollm2 --mode step --length 1024 --tokens 16 --rounds 5

Kernels (each holds the same stacked groups the step multiplies by: q/k/v, o, gate/up, down, the head):
  grid      gali's bytes: uint8 codes and a float32 step and base per block of 32 (exact for GGUF's formats)
  int4      torch.ops.aten._weight_int4pack_mm_for_cpu, groups of 32 (scale, zero) taken from the grid where its
            codes are 4-bit (Q4_0/Q4_1: exact to float32 rounding); a group that is not (Q8_0's head) in float32
  int4-bf16 the same with bfloat16 activations, scales and zeros (torch's vectorised path; lossy)
  int8      torch.ops.aten._weight_int8pack_mm: int8 per row with one scale a row (lossy for per-block formats)
  int8-bf16 the same with bfloat16 activations and scales
  bfloat16  F.linear over bfloat16 weights, the input cast to bfloat16 and the output back (lossy)
  float32   F.linear over the stacked float32 weights
  modules   the model's own float32 modules, unstacked (the static step without grids: what dropping them leaves)

--mode ops: one product of one row (decode) per group shape, all kernels in turn within each round (the order
rotated each round), so every ratio is measured side by side; median and range over rounds of the time per call,
and the per-token sum (each layer group times the layers, plus the head). The outputs' max abs difference to a
float64 product of the model's float32 weights, and to the grid's.
--mode step: the static decoding step (engine/static_decode.py, native attention) on one prefilled cache, its
projections through each kernel in turn, `--tokens` tokens per kernel per round; median ms a token and range over
rounds, and the logits' max abs difference to the grid step's and to the float32 modules' (same token ids).
Memory: each kernel's bytes for all projections, held beside the model's float32 weights (which prefill uses).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as gali runs (gali_cli/threads.py), set before torch loads

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speed import build_model, check_choices, run_context

from gali_cli.engine.seam.grid_weights import BLOCK, to_grid
from gali_cli.engine.seam.hooks import llama_model
from gali_cli.engine.seam.projections import LayerProjections, Projections, module_projections

KERNELS = ("grid", "int4", "int4-bf16", "int8", "int8-bf16", "bfloat16", "float32", "modules")
GROUPS = ("qkv", "output", "gate_up", "down", "head")


class TorchWeight:
    """A stacked weight multiplied by one of torch's kernels, called as grid_weights.GridWeight is (`norm`, `gated`,
    `into`), so that the static step's LayerProjections takes it in a GridWeight's place."""

    def __init__(self, product: Callable[[torch.Tensor], torch.Tensor], nbytes: int) -> None:
        self.product, self.bytes = product, nbytes

    def nbytes(self) -> int:
        return self.bytes

    def __call__(self, x: torch.Tensor, gated: bool = False, norm: nn.Module | None = None,
                 into: torch.Tensor | None = None) -> torch.Tensor:
        y = self.product(norm(x) if norm is not None else x)
        if gated:  # gate rows above up rows: SiLU(gate) * up
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        return into.add_(y) if into is not None else y


def float32_weight(matrix: torch.Tensor) -> TorchWeight:
    return TorchWeight(lambda x: F.linear(x, matrix), 0)  # the model's weights, stacked (a copy, not counted)


def bfloat16_weight(matrix: torch.Tensor) -> TorchWeight:
    held = matrix.bfloat16()
    return TorchWeight(lambda x: F.linear(x.bfloat16(), held).float(), held.numel() * 2)


def int8_weight(matrix: torch.Tensor, dtype: torch.dtype) -> TorchWeight:
    """Symmetric int8 per row: weight ~ scale[n] * q[n, m]; activations and scales in `dtype`."""
    scales = (matrix.abs().amax(dim=1) / 127).clamp(min=1e-12)
    codes = torch.round(matrix / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    scales = scales.to(dtype)

    def product(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(dtype)
        return torch.ops.aten._weight_int8pack_mm(flat, codes, scales).float().view(*x.shape[:-1], -1)

    return TorchWeight(product, codes.numel() + scales.numel() * 4)


def int4_weight(matrix: torch.Tensor, dtype: torch.dtype) -> TorchWeight | None:
    """torch's int4 groups of BLOCK, read off the grid where every block's codes are 4-bit: codes 17 * q with the
    step d / 17 (a block spanning 0..15, step = range / 255) or q itself (step d); None where a block is not 4-bit.
    torch's dequantisation: (q - 8) * scale + zero, activations, scales and zeros in `dtype`."""
    grid = to_grid([matrix])
    if grid is None:
        return None
    rows, columns = grid.codes.shape
    codes = grid.codes.view(rows, columns // BLOCK, BLOCK).int()
    seventeens = (codes % 17 == 0).all(dim=-1, keepdim=True)
    q = torch.where(seventeens, codes // 17, codes)
    if int(q.max()) > 15:
        return None
    scale = torch.where(seventeens.squeeze(-1), grid.step * 17, grid.step)  # (N, M / BLOCK)
    zero = grid.base + 8 * scale
    scale_zero = torch.stack((scale.t(), zero.t()), dim=-1).to(dtype).contiguous()  # (M / BLOCK, N, 2)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(rows, columns).contiguous(), 1)

    def product(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, BLOCK, scale_zero)
        return out.float().view(*x.shape[:-1], -1)

    return TorchWeight(product, packed.numel() + scale_zero.numel() * scale_zero.element_size())


def held(kernel: str, weights: list[torch.Tensor]):
    """One group's stacked weights held for `kernel` (int4: float32 where the group is not 4-bit)."""
    matrix = torch.cat([w.detach() for w in weights]).contiguous()
    if kernel == "grid":
        return to_grid([matrix])
    dtype = torch.bfloat16 if kernel.endswith("-bf16") else torch.float32
    if kernel.startswith("int4"):
        return int4_weight(matrix, dtype) or float32_weight(matrix)
    if kernel.startswith("int8"):
        return int8_weight(matrix, dtype)
    return {"bfloat16": bfloat16_weight, "float32": float32_weight}[kernel](matrix)


def group_weights(model: nn.Module) -> list[dict[str, list[torch.Tensor]]]:
    """Per layer, then the head: each group's weights as the static step stacks them."""
    layers = [{"qkv": [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], "output": [a.o_proj.weight],
               "gate_up": [m.gate_proj.weight, m.up_proj.weight], "down": [m.down_proj.weight]}
              for a, m in ((layer.self_attn, layer.mlp) for layer in llama_model(model).layers)]
    return [*layers, {"head": [model.get_output_embeddings().weight]}]


def projections(model: nn.Module, kernel: str) -> tuple[Projections, int]:
    """The static step's projections through `kernel`, and their bytes beside the model's float32 weights."""
    if kernel == "modules":
        return module_projections(model), 0
    groups = group_weights(model)
    base = llama_model(model)
    layers = tuple(LayerProjections(layer, **{name: held(kernel, weights) for name, weights in group.items()})
                   for layer, group in zip(base.layers, groups[:-1], strict=True))
    head = held(kernel, groups[-1]["head"])
    result = Projections(layers, base.norm, model.get_output_embeddings(), head)
    return result, sum(w.nbytes() for w in result.grids())


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure_ops(model: nn.Module, kernels: list[str], rounds: int, seconds: float) -> list[dict]:
    """Each group's product of one row, every kernel side by side in each round. A sample runs the group of every
    layer in turn, as a decoding step does, so that each matrix comes from memory, not from a cache that a loop
    over one matrix would keep it in (SmolLM2's q/k/v in float32 are 2.2 MB)."""
    groups = group_weights(model)
    modules = module_groups(model)
    rows = []
    for name in GROUPS:
        per_layer = [group[name] for group in groups if name in group]
        x = torch.randn(1, per_layer[0][0].shape[1], generator=torch.Generator().manual_seed(0))
        products = {kernel: modules[name] if kernel == "modules" else [held(kernel, w) for w in per_layer]
                    for kernel in kernels}
        outputs = {kernel: [product(x) for product in layer_products] for kernel, layer_products in products.items()}
        exact = [(x.double() @ torch.cat(w).double().t()).float() for w in per_layer]

        def sample(layer_products: list, x: torch.Tensor = x) -> None:
            for product in layer_products:
                product(x)

        calls = {kernel: calibrate(lambda p=products[kernel]: sample(p), seconds) for kernel in kernels}
        times = {kernel: [] for kernel in kernels}
        for turn in range(rounds):
            for kernel in kernels[turn % len(kernels):] + kernels[: turn % len(kernels)]:
                start = time.perf_counter()
                for _ in range(calls[kernel]):
                    sample(products[kernel])
                times[kernel].append(1e6 * (time.perf_counter() - start) / calls[kernel] / len(per_layer))

        def largest_difference(made: list[torch.Tensor], to: list[torch.Tensor]) -> float:
            return max(float((a - b).abs().max()) for a, b in zip(made, to, strict=True))

        for kernel in kernels:
            rows.append({"group": name, "shape": [sum(w.shape[0] for w in per_layer[0]), per_layer[0][0].shape[1]],
                         "kernel": kernel, "us": spread(times[kernel]), "count": len(per_layer),
                         "bytes": sum(getattr(p, "nbytes", lambda: 0)() for p in products[kernel]),
                         "diff_exact": largest_difference(outputs[kernel], exact),
                         "diff_grid": largest_difference(outputs[kernel], outputs["grid"]) if "grid" in outputs
                         else None, "largest": max(float(e.abs().max()) for e in exact)})
    return rows


def module_groups(model: nn.Module) -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    """Per group, each layer's products as the model's own modules make them, one call a module, concatenated."""
    def joined(modules: list[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: torch.cat([m(x) for m in modules], dim=-1)

    parts = [(layer.self_attn, layer.mlp) for layer in llama_model(model).layers]
    return {"qkv": [joined([a.q_proj, a.k_proj, a.v_proj]) for a, _ in parts],
            "output": [joined([a.o_proj]) for a, _ in parts],
            "gate_up": [joined([m.gate_proj, m.up_proj]) for _, m in parts],
            "down": [joined([m.down_proj]) for _, m in parts], "head": [joined([model.get_output_embeddings()])]}


def calibrate(run: Callable[[], object], seconds: float) -> int:
    """Calls of `run` that take about `seconds`."""
    run()
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds / 4:
        run()
        count += 1
    return max(1, int(count * 4 * seconds / max(time.perf_counter() - start, 1e-9)))


def measure_step(model: nn.Module, kernels: list[str], length: int, tokens: int, rounds: int) -> list[dict]:
    """The static decoding step through each kernel, side by side on one prefilled cache."""
    from gali_cli.engine.seam.cache_argument import with_cache
    from gali_cli.engine.seam.kv_cache import new_cache, reserve
    from gali_cli.engine.seam.static_decode import StaticDecoder
    from gali_cli.generate import truncate_cache

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, length + tokens + 1), generator=generator)
    cache = new_cache(model)
    reserve(cache, length + tokens + 1)
    given = with_cache(model, cache)
    model(input_ids=ids[:, :length], **given, use_cache=True, logits_to_keep=1)
    decoder = StaticDecoder(model, cache, route="native")
    decoder.first_step(int(ids[0, length]), length, lambda: model(
        input_ids=ids[:, length: length + 1], **given, use_cache=True).logits[0, -1])
    if not decoder.checked:
        raise SystemExit(f"the static step differs from the forward here ({decoder.difference})")
    held_by = {}
    for kernel in kernels:
        started = time.perf_counter()
        held_by[kernel] = (*projections(model, kernel), time.perf_counter() - started)
    times = {kernel: [] for kernel in kernels}
    logits = {}
    for turn in range(rounds):
        for kernel in kernels[turn % len(kernels):] + kernels[: turn % len(kernels)]:
            decoder.projections = held_by[kernel][0]
            truncate_cache(cache, length + 1)
            per_token, made = [], []
            for index in range(length + 1, length + 1 + tokens):
                start = time.perf_counter()
                made.append(decoder.step(int(ids[0, index]), index).clone())
                per_token.append(1000 * (time.perf_counter() - start))
            times[kernel].append(statistics.median(per_token))
            logits.setdefault(kernel, torch.stack(made))
    rows = []
    for kernel in kernels:
        row = {"kernel": kernel, "ms": spread(times[kernel]), "bytes": held_by[kernel][1],
               "prepare_s": held_by[kernel][2], "largest": float(logits[kernel].abs().max())}
        for other in ("grid", "modules"):
            if other in logits:
                row[f"diff_{other}"] = float((logits[kernel] - logits[other]).abs().max())
                same = logits[kernel].argmax(-1) == logits[other].argmax(-1)
                row[f"same_token_{other}"] = float(same.float().mean())
        rows.append(row)
    return rows


def print_ops(rows: list[dict], kernels: list[str]) -> None:
    """A row per kernel: µs per call per group (median, range), the per-token sum, bytes, and the largest output
    difference over the groups relative to the group's largest output."""
    groups = [g for g in GROUPS if any(r["group"] == g for r in rows)]
    shapes = {r["group"]: "x".join(map(str, r["shape"])) for r in rows}
    print("| kernel | " + " | ".join(f"{g} {shapes[g]} µs" for g in groups) + " | per token ms | x fastest | MB "
          "beside float32 | max diff / largest: to float64, to grid |")
    print("|---" * (len(groups) + 5) + "|")
    totals = {k: sum(r["us"]["median"] * r["count"] for r in rows if r["kernel"] == k) / 1000 for k in kernels}
    fastest = min(totals.values())
    for kernel in kernels:
        cells = {r["group"]: r for r in rows if r["kernel"] == kernel}
        megabytes = sum(r["bytes"] for r in cells.values()) / 1e6
        exact = max(r["diff_exact"] / r["largest"] for r in cells.values())
        grid = max((r["diff_grid"] / r["largest"] for r in cells.values() if r["diff_grid"] is not None),
                   default=float("nan"))
        print(f"| {kernel} | " + " | ".join(
            f"{cells[g]['us']['median']:.0f} ({cells[g]['us']['min']:.0f}-{cells[g]['us']['max']:.0f})"
            for g in groups) + f" | {totals[kernel]:.2f} | {totals[kernel] / fastest:.2f} | {megabytes:.0f} | "
            f"{exact:.1e}, {grid:.1e} |")


def print_step(rows: list[dict]) -> None:
    fastest = min(r["ms"]["median"] for r in rows)
    print("| kernel | ms a token (range) | x fastest | MB beside float32 | prepared in s | logits' max abs diff to "
          "grid / to float32 modules | same argmax as grid / modules |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['ms']['median']:.2f} ({r['ms']['min']:.2f}-{r['ms']['max']:.2f}) | "
              f"{r['ms']['median'] / fastest:.3f} | {r['bytes'] / 1e6:.0f} | {r['prepare_s']:.2f} | "
              f"{r.get('diff_grid', float('nan')):.1e} / {r.get('diff_modules', float('nan')):.1e} | "
              f"{r.get('same_token_grid', float('nan')):.0%} / {r.get('same_token_modules', float('nan')):.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default="smollm2", help="a model as gali loads it (default smollm2)")
    parser.add_argument("--mode", choices=("ops", "step"), default="ops")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"any of {', '.join(KERNELS)}")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=0.02, help="ops: seconds per kernel per group per round")
    parser.add_argument("--length", type=int, default=1024, help="step: tokens prefilled")
    parser.add_argument("--tokens", type=int, default=16, help="step: tokens decoded per kernel per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the rows and the run's context to this file")
    args = parser.parse_args()
    kernels = args.kernels.split(",")
    check_choices(parser, kernels, KERNELS, "kernels")
    torch.set_num_threads(args.threads)
    args.device, args.dtype, args.layers = "cpu", "float32", 0
    model = build_model(args)
    load_before = os.getloadavg()
    with torch.inference_mode():
        if args.mode == "ops":
            rows = measure_ops(model, kernels, args.rounds, args.seconds)
            print_ops(rows, kernels)
        else:
            rows = measure_step(model, kernels, args.length, args.tokens, args.rounds)
            print_step(rows)
    context = run_context(load_before)
    print(f"\nload average (1, 5, 15 min) before {load_before}, after {context['load_after']}; torch "
          f"{torch.__version__} ({context['cpu']}), {args.threads} threads, OMP_WAIT_POLICY "
          f"{context['omp_wait_policy']}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"context": context, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
