"""GALI (paper §3, Algorithms 1-3) as a position-remapping attention (its public apply / remove functions are in
gali_cli/patching.py, which installs it)."""

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from ..config import GaliConfig, MethodSettings
from ..engine.attention.decode import DecodeStep, decode_attention, decode_step
from ..engine.attention.gali_attention import chunk_contexts, gali_attention, noisy
from ..engine.checks import reference_model as ref
from ..engine.contract import Forward, KeptKeys, Placement, PositionalAttention
from ..engine.math.noise import Noise
from ..engine.math.positions import chunk_plan, key_positions, planned_chunks
from ..engine.math.rope import absolute_table
from ..model.families import default_train_len
from .method import Method, SeamExample


class Gali(PositionalAttention):
    """Each forward is cut into GALI chunks; each chunk attends with positions recomputed for all its keys.

    Decoding (one-token forwards on a cache, outside autograd) keeps each layer's rotated keys from token to token
    (engine.decode.decode_attention, engine.kept_keys), per cache object: any longer forward on that cache starts them
    again.
    """

    name = "gali"
    fast_decode = True  # False: decode like any other chunk, re-rotating every key (the reference in tests)

    def __init__(self, config: GaliConfig) -> None:
        self.config = config  # resolved: no None left
        self.exact_until = config.train_len
        self._kept = KeptKeys()  # decoding's rotated keys, per cache and layer
        self._plan: list[list[tuple[int, int]]] = []  # the last prefill's chunks, one list per stretch between cuts

    def chunk_ends(self, start: int, stop: int, cuts: list[int] = ()) -> list[int]:
        """Where a forward over tokens [start, stop) may end without changing the results: its chunks' ends (Alg. 1),
        each of `cuts` ending a forward too."""
        return [last for stretch in self._planned(start, stop, cuts) for _, last in stretch]

    def keep_plan(self, start: int, stop: int, cuts: list[int] = ()) -> list[int]:
        """`chunk_ends` for a prefill, whose forwards then take their chunks from this plan instead of planning
        again."""
        self._plan = self._planned(start, stop, cuts)
        return [last for stretch in self._plan for _, last in stretch]

    def _planned(self, start: int, stop: int, cuts: list[int]) -> list[list[tuple[int, int]]]:
        return planned_chunks(start, stop, cuts, self.config.train_len, self.config.chunk_size)

    def chunks(self, start: int, stop: int) -> list[tuple[int, int]]:
        """GALI's chunks of a forward over [start, stop): a run of the planned ones where it starts and ends at chunk
        boundaries of the plan (chunk_plan's pieces between two of its boundaries are its own), else planned now."""
        for stretch in self._plan:
            firsts = [first for first, _ in stretch]
            lasts = [last for _, last in stretch]
            if start in firsts and stop in lasts and firsts.index(start) <= lasts.index(stop):
                return stretch[firsts.index(start) : lasts.index(stop) + 1]
        return chunk_plan(start, stop, self.config.train_len, self.config.chunk_size)

    def table_rows(self, start: int, stop: int) -> int:
        # Positions reach train_len - 1, or train_len itself when there is no local window (Alg. 2's edge).
        return min(stop, self.config.train_len + (self.config.local_window == 0))

    def decode_placement(self, query: torch.Tensor, keys: torch.Tensor) -> Placement:
        """Alg. 2 for query + 1 keys, on tensors (positions.key_positions): grouped keys at j / g between
        ceil and floor, the exact tail at j - (T - L), the query where its own key sits; noise on the fractional
        keys, sigma = (i - j) / T."""
        train_len = self.config.train_len
        total = query + 1
        positions = key_positions(keys, total, train_len, self.config.local_window)
        fractional = positions.weight > 0
        sigma = None
        if self.config.noise:
            sigma = torch.where(fractional, (query - keys).float() * self.config.noise_scale / total.float(), 0.0)
        at = positions.ceil.gather(0, query.view(1))  # the query's own position (gather: no index read on the host)
        # Positions lie in [0, train_len - 1] (train_len: a query's own, with no local window), the query's the
        # largest: offsets in [-train_len, 0] (tests/engine/seam/test_static_decode.py).
        return Placement(positions.ceil - at, positions.weight, sigma, reach=train_len)

    def noise(self, layer: int) -> Noise | None:
        """The paper's logit noise for layer `layer`, where --noise asks for it."""
        return Noise(self.config.seed, layer, self.config.noise_scale) if self.config.noise else None

    def attend(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        config = self.config
        noise = self.noise(module.layer_idx)
        if forward.cache is not None:
            if self.fast_decode and forward.stop - forward.start == 1 and not torch.is_grad_enabled():
                return self._decode(forward, module, query, key, value, scaling, noise)
            self._kept.forget(forward.cache)  # the cache grew by more than a token

        def build_chunks():
            pieces = self.chunks(forward.start, forward.stop)
            table = forward.table(query.device, query.dtype)
            return chunk_contexts(table, pieces, config.train_len, config.local_window)

        chunks = forward.memo(("gali", query.device, query.dtype), build_chunks)
        outputs = []
        if not chunks[0].interpolated:  # only the first piece can lie inside the training window
            window, chunks = chunks[0], chunks[1:]
            outputs.append(forward.exact_attention(module, query, key, value, window.keys, scaling, dropout, **kwargs))
        plan = forward.attention_plan(query, key, value, dropout, noisy(chunks, noise))
        beyond = query[:, :, query.shape[2] - sum(chunk.queries for chunk in chunks) :]
        outputs.append(gali_attention(beyond, key, value, chunks, scaling, plan, dropout, noise).transpose(1, 2))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def _decode(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, scaling: float, noise: Noise | None) -> torch.Tensor:
        layer, stop = module.layer_idx, forward.stop
        origin = self._kept.frame(forward.cache, layer, key, forward.start)

        def build_step() -> DecodeStep:
            rotary = forward.installed.rotary
            absolute = absolute_table(rotary.inv_freq, rotary.attention_scaling, query.dtype)
            return decode_step(origin, forward.stop, forward.table(query.device, query.dtype), absolute,
                               self.config.train_len, self.config.local_window)

        step = forward.memo(("decode", query.device, query.dtype, origin), build_step)  # shared by the layers
        rotated = self._kept.buffer(forward.cache, layer, key, stop, 0 if step.rebuild else forward.start)
        plan = forward.attention_plan(query, key, value, 0.0, noise is not None)  # decoding draws no dropout
        output = decode_attention(query, key[:, :, :stop], value[:, :, :stop], rotated, step, scaling, plan, noise)
        self._kept.keep(forward.cache, layer, stop, (step.group, step.grouped), rotated)
        return output.transpose(1, 2)


def gali_config(config: PretrainedConfig, settings: MethodSettings, train_len: int) -> GaliConfig:
    """GALI's settings for a model with this config, every None filled in."""
    return replace(settings.gali(), train_len=train_len).resolved(default_train_len(config))


def _reference(noise: tuple[int, float] | None = None) -> Callable[[nn.Module, dict], ref.NaiveGali]:
    """GALI's float64 restatement on the seam check's patched model, with its resolved settings."""
    return lambda model, s: ref.NaiveGali(model, s["train_len"], s["chunk_size"], s["local_window"], noise=noise)


METHOD = Method("gali", lambda config, settings, train_len, tokens: gali_config(config, settings, train_len).facts(),
                lambda config, settings, s: Gali(gali_config(config, settings, s["train_len"])),
                boundaries=lambda method, start, stop, cuts: method.chunk_ends(start, stop, cuts),
                plan=lambda method, start, stop, cuts: method.keep_plan(start, stop, cuts),
                step=lambda method: 8 * method.config.chunk_size,  # 8 chunks a forward
                examples=(SeamExample("gali", MethodSettings(chunk_size=4, local_window=2), _reference()),
                          SeamExample("gali with noise", MethodSettings(chunk_size=4, local_window=2, noise=True,
                                                                        noise_seed=3), _reference(noise=(3, 1.0)))))
