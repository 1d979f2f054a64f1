"""A deliberately naive restatement of a Llama forward and of each method's positions, in float64: the model-level
reference of the tests and of `gali info --check`'s seam check (gali_cli/seam_check.py).

It shares nothing with the rest of the engine but the noise's random numbers (a definition, not an algorithm), and
nothing with transformers but the weights: the paper's loops (Appendix D, Algorithms 1-3) are written out
literally, every chunk builds full logit matrices from two rotated copies of the keys, and the Llama layer is
spelled out from its weights. So a patched transformers model that agrees with it agrees for the right reasons,
whatever the installed release does with its arguments. Keep it small and slow: it is an oracle, not a path.
"""

import math

import torch

from ...model.families import GLOBAL, LOCAL, family_of, layer_is_local
from ..math.noise import Noise, standard_normal


def alg1_chunk_sizes(prefill_len: int, train_len: int, chunk_size: int) -> list[int]:
    """Algorithm 1, line by line."""
    sizes = [train_len]
    total = train_len
    while total < prefill_len:
        sizes.append(chunk_size)
        total += chunk_size
    sizes[-1] -= total - prefill_len
    return sizes


def alg2_positions(cur_len: int, train_len: int, add_token: int, local_window: int) -> list[float]:
    """Algorithm 2, line by line (only meaningful when cur_len + add_token > train_len)."""
    target_len = cur_len + add_token
    min_group_size = math.ceil((target_len - local_window) / (train_len - local_window))
    interval = 1 / min_group_size
    total_len = train_len
    new_pi: list[float] = []
    i = 0
    while total_len < target_len:
        new_pi += [i + interval * j for j in range(min_group_size)]
        i += 1
        total_len = train_len - i + len(new_pi)
    seg_window = list(range(i, train_len))
    return new_pi[: target_len - len(seg_window)] + seg_window


def chunk_positions(cur_len: int, add_token: int, train_len: int, local_window: int) -> list[float]:
    """Positions of all keys of a chunk: plain within the training window, Algorithm 2 beyond it."""
    if cur_len + add_token <= train_len:
        return [float(p) for p in range(cur_len + add_token)]
    return alg2_positions(cur_len, train_len, add_token, local_window)


class NaiveLlama:
    """A Llama spelled out from its weights, in float64, one forward per call, K/V cached without RoPE; with the
    q/k/v biases (Qwen2) and the per-head q/k RMSNorms before RoPE (Qwen3, Gemma 3) where the weights hold them,
    and what model/families.py declares of Gemma 3: local layers on their own rope within their window (the
    methods' positions on the global layers only), logits scaled by query_pre_attn_scalar^-1/2, embeddings times
    sqrt(hidden), RMSNorms by 1 + weight, the attention's and MLP's outputs normed, a GELU MLP.

    Subclasses give the attention logits of one head of a global layer: `logits(q (n, D), keys (T, D), first,
    layer, head)`, scaled by `logit_scale` (1/sqrt(d) on a Llama), for the queries of tokens first..first+n-1 over
    the keys of tokens 0..T-1; the causal mask, softmax and the rest of the layer are here.
    """

    def __init__(self, model, batch_index: int = 0):
        self.config = model.config
        self.weights = {name: tensor.detach().double() for name, tensor in model.state_dict().items()}
        self.weights["lm_head.weight"] = model.lm_head.weight.detach().double()
        self.dtype = model.lm_head.weight.dtype
        rotary = model.model.rotary_emb
        # The rotary in use: a rescaled one (ntk, yarn), or the model's own behind a method's stand-in.
        rotary = getattr(rotary, "rescaled", None) or getattr(rotary, "rotary", rotary)
        self.family = family_of(self.config)
        # Two kinds of layers (Gemma 3): the methods' positions on the global layers' rope; the local layers' own.
        # (A config of one kind only has no rope of the other.)
        prefix = f"{GLOBAL}_" if self.family.layer_kinds else ""
        if hasattr(rotary, prefix + "inv_freq"):
            self.inv_freq = getattr(rotary, prefix + "inv_freq").detach().double()
            self.rope_scaling = float(getattr(rotary, prefix + "attention_scaling"))
        if hasattr(rotary, f"{LOCAL}_inv_freq"):
            self.local_inv_freq = getattr(rotary, f"{LOCAL}_inv_freq").detach().double()
            self.local_rope_scaling = float(getattr(rotary, f"{LOCAL}_attention_scaling"))
        # The logits' scale: Gemma's query_pre_attn_scalar^-1/2, a Llama's 1/sqrt(head_dim).
        pre_scalar = getattr(self.config, "query_pre_attn_scalar", None)
        self.pre_attn_scale = None if pre_scalar is None else pre_scalar ** -0.5
        self.batch_index = batch_index
        layers = self.config.num_hidden_layers
        self.keys: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self.values: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self.length = 0

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """The whole prompt in one forward; returns every token's logits (len(ids), vocab)."""
        return self.forward(ids)

    def greedy(self, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
        """Prefill, then decode `steps` tokens greedily, one forward each."""
        logits = self.prefill(prompt)[-1]
        tokens, step_logits = [], []
        for _ in range(steps):
            token = int(logits.argmax())
            tokens.append(token)
            step_logits.append(logits)
            logits = self.forward([token])[-1]
        return tokens, step_logits

    def forward(self, ids: list[int]) -> torch.Tensor:
        w, cfg, family = self.weights, self.config, self.family
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        first, new = self.length, len(ids)
        total = first + new
        x = w["model.embed_tokens.weight"][torch.tensor(ids)]
        if family.embedding_scale:  # Gemma: times sqrt(hidden), as the model's dtype holds it
            x = x * torch.tensor(cfg.hidden_size**0.5, dtype=self.dtype).double()
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            local = layer_is_local(cfg, layer)
            h = self._rms_norm(x, w[p + "input_layernorm.weight"])
            q = self._projection(h, p + "self_attn.q_proj").view(new, heads, head_dim)
            k = self._projection(h, p + "self_attn.k_proj").view(new, kv_heads, head_dim)
            if p + "self_attn.q_norm.weight" in w:  # Qwen3, Gemma 3: each head's q and k RMS-normed before RoPE
                q = self._rms_norm(q, w[p + "self_attn.q_norm.weight"])
                k = self._rms_norm(k, w[p + "self_attn.k_norm.weight"])
            self.keys[layer].append(k)
            self.values[layer].append(self._projection(h, p + "self_attn.v_proj").view(new, kv_heads, head_dim))
            keys, values = torch.cat(self.keys[layer]), torch.cat(self.values[layer])
            if not local:
                self.prepare(q, keys, first, layer)
            heads_out = []
            query_index = torch.arange(first, total).unsqueeze(1)
            masked = torch.arange(total).unsqueeze(0) > query_index
            if local:  # a local layer: its own rope at the true positions, keys within the window only
                masked = masked | (query_index - torch.arange(total).unsqueeze(0) >= cfg.sliding_window)
            for head in range(heads):
                kv = head // (heads // kv_heads)
                if local:
                    logits = self.local_logits(q[:, head], keys[:, kv], first)
                else:
                    logits = self.logits(q[:, head], keys[:, kv], first, layer, head)
                logits = logits.masked_fill(masked, float("-inf"))
                heads_out.append(torch.softmax(logits, dim=-1) @ values[:, kv])
            attention = torch.cat(heads_out, dim=-1) @ w[p + "self_attn.o_proj.weight"].T
            if family.sandwich_norms:  # Gemma: the attention's output normed; the MLP between two norms of its own
                x = x + self._rms_norm(attention, w[p + "post_attention_layernorm.weight"])
                h = self._rms_norm(x, w[p + "pre_feedforward_layernorm.weight"])
                x = x + self._rms_norm(self._mlp(h, p), w[p + "post_feedforward_layernorm.weight"])
            else:
                x = x + attention
                h = self._rms_norm(x, w[p + "post_attention_layernorm.weight"])
                x = x + self._mlp(h, p)
        self.length = total
        logits = self._rms_norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T
        cap = getattr(cfg, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _mlp(self, h: torch.Tensor, p: str) -> torch.Tensor:
        """The gated MLP, with the config's activation (a Llama's SiLU, Gemma's tanh-approximated GELU)."""
        w = self.weights
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        activation = getattr(self.config, "hidden_activation", None) or getattr(self.config, "hidden_act", "silu")
        if activation == "silu":
            gate = torch.nn.functional.silu(gate)
        elif activation in ("gelu_pytorch_tanh", "gelu_tanh"):
            gate = torch.nn.functional.gelu(gate, approximate="tanh")
        else:
            raise ValueError(f"no restatement of the activation {activation!r}")
        return (gate * up) @ w[p + "mlp.down_proj.weight"].T

    def local_logits(self, query, keys, first):
        """A local layer's logits: its own rope, at the true positions."""
        positions = torch.arange(first, first + len(query)), torch.arange(len(keys))
        rotated = [self.rope(x, at, self.local_inv_freq, self.local_rope_scaling) for x, at in zip((query, keys),
                                                                                                 positions)]
        return rotated[0] @ rotated[1].T * self.logit_scale(query)

    def logit_scale(self, query: torch.Tensor) -> float:
        """What a logit q.k is multiplied by: the config's query_pre_attn_scalar^-1/2 (Gemma), else 1/sqrt(d)."""
        return self.pre_attn_scale if self.pre_attn_scale is not None else 1 / math.sqrt(query.shape[-1])

    def prepare(self, queries, keys, first, layer):
        """Before a global layer's heads: what a method decides from all its queries (n, H, D) and keys (T, Hkv, D)
        at once (ReAttention's selection)."""

    def logits(self, query, keys, first, layer, head):
        raise NotImplementedError

    def rope_logits(self, query, keys, query_positions, key_positions) -> torch.Tensor:
        """f(q, P_q)^T f(k, P_k) / sqrt(d) for every query/key pair, positions as float tensors."""
        return self.rope(query, query_positions) @ self.rope(keys, key_positions).T * self.logit_scale(query)

    def _projection(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x W^T, plus the bias where the model has one (Qwen2's q/k/v)."""
        bias = self.weights.get(name + ".bias")
        return x @ self.weights[name + ".weight"].T + (0 if bias is None else bias)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm by the weight (a Llama's), or by offset + weight (Gemma's 1 + weight)."""
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps) * (
            weight + self.family.norm_offset if self.family.norm_offset else weight)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None = None,
             scaling: float | None = None) -> torch.Tensor:
        """x rotated at `positions`: (n,), or (n, D/2) for a position per frequency (by the methods' rope unless
        `inv_freq` and `scaling` are given: a local layer's)."""
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        scaling = self.rope_scaling if scaling is None else scaling
        positions = positions.double()
        angles = positions * inv_freq if positions.dim() == 2 else positions.unsqueeze(1) * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * angles.cos() * scaling + rotated * angles.sin() * scaling


class NaiveRoPE(NaiveLlama):
    """The unpatched model: RoPE at the true positions i and j (with the rotary's own frequencies and scaling, so
    also static NTK and YaRN, which change only those)."""

    def logits(self, query, keys, first, layer, head):
        return self.rope_logits(query, keys, torch.arange(first, first + len(query)), torch.arange(len(keys)))


class NaiveChunked(NaiveLlama):
    """A method that reads a prompt in Algorithm 1's chunks (`train_len` tokens, then `chunk_size` each), one
    forward a chunk, and one token a forward after (GALI, ReAttention): subclasses set both attributes."""

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Algorithm 1's chunks, in order."""
        logits, start = [], 0
        for size in alg1_chunk_sizes(len(ids), self.train_len, self.chunk_size):
            logits.append(self.forward(ids[start : start + size]))
            start += size
        return torch.cat(logits)


class NaiveGali(NaiveChunked):
    """GALI, one Algorithm-1 chunk per forward during prefill, one token per forward after.

    Args:
        noise: (seed, scale) to add the paper's logit noise, or None.
        batch_index: which row of a batch this sequence is (the noise differs per row).
    """

    def __init__(self, model, train_len, chunk_size, local_window, noise=None, batch_index=0):
        super().__init__(model, batch_index)
        self.train_len, self.chunk_size, self.local_window, self.noise = train_len, chunk_size, local_window, noise

    def chunk(self, ids: list[int]) -> torch.Tensor:
        return self.forward(ids)

    def logits(self, query, keys, first, layer, head):
        total = len(keys)
        positions = torch.tensor(chunk_positions(first, total - first, self.train_len, self.local_window),
                                 dtype=torch.float64)
        query_positions = positions[first:]
        # Algorithm 3: queries at ceil(p); keys at ceil(p) and at floor(p); interpolate the two logits.
        attn_floor = self.rope_logits(query, keys, query_positions.ceil(), positions.ceil())
        attn_ceil = self.rope_logits(query, keys, query_positions.ceil(), positions.floor())
        rel_coef = torch.remainder(query_positions.ceil().unsqueeze(1) - positions.unsqueeze(0), 1)
        logits = attn_floor - (attn_floor - attn_ceil) * rel_coef
        if self.noise is not None:
            seed, scale = self.noise
            heads = self.config.num_attention_heads
            samples = standard_normal(Noise(seed, layer, scale), self.batch_index + 1, heads,
                                      torch.arange(first, total), total)[self.batch_index, head].double()
            distance = torch.arange(first, total).unsqueeze(1) - torch.arange(total).unsqueeze(0)
            logits = logits + samples * (distance / total * scale) * (rel_coef != 0)
        return logits


class NaiveSelfExtend(NaiveLlama):
    """SelfExtend (Jin et al. 2024): neighbour logits with true positions where i - j < W, grouped logits with
    positions i // G + W - W // G and j // G elsewhere, each from its own full matrix."""

    def __init__(self, model, group_size, neighbor_window):
        super().__init__(model)
        self.group_size, self.neighbor_window = group_size, neighbor_window

    def logits(self, query, keys, first, layer, head):
        g, w = self.group_size, self.neighbor_window
        i = torch.arange(first, first + len(query))
        j = torch.arange(len(keys))
        neighbor = self.rope_logits(query, keys, i, j)
        grouped = self.rope_logits(query, keys, i // g + w - w // g, j // g)
        return torch.where(i.unsqueeze(1) - j.unsqueeze(0) < w, neighbor, grouped)


class NaiveSELF(NaiveLlama):
    """SELF (arXiv 2505.17296): SelfExtend whose grouped position x holds min(floor(f(x)), c - 1) tokens, f(x) =
    c / (1 + (c - 1) e^(-r x)), filled in order from token 0; neighbour logits with true positions where i - j < W,
    grouped logits with the key at its group's position G(j) and the query at W + G(i - W) elsewhere."""

    def __init__(self, model, capacity, rate, neighbor_window):
        super().__init__(model)
        self.capacity, self.rate, self.neighbor_window = capacity, rate, neighbor_window

    def group_of_each_token(self, tokens: int) -> list[int]:
        """G(0..tokens-1): position after position, as many tokens as the logistic size says."""
        c, r = self.capacity, self.rate
        groups, position = [], 0
        while len(groups) < tokens:
            size = min(math.floor(c / (1 + (c - 1) * math.exp(-r * position))), c - 1)
            groups += [position] * size
            position += 1
        return groups[:tokens]

    def logits(self, query, keys, first, layer, head):
        w = self.neighbor_window
        i = torch.arange(first, first + len(query))
        j = torch.arange(len(keys))
        groups = self.group_of_each_token(len(keys))
        query_positions = torch.tensor([w + groups[max(index - w, 0)] for index in i.tolist()])
        neighbor = self.rope_logits(query, keys, i, j)
        grouped = self.rope_logits(query, keys, query_positions, torch.tensor(groups))
        return torch.where(i.unsqueeze(1) - j.unsqueeze(0) < w, neighbor, grouped)


class NaiveDualChunk(NaiveLlama):
    """Dual Chunk Attention (An et al. 2024), Eq. 2-8: P_k = j mod s; P_intra = i mod s; P_succ = s + i mod s for
    the first w positions of a chunk, else c - 1; P_inter = c - 1; chosen by how many chunks apart i and j are."""

    def __init__(self, model, chunk_size, local_window, pretraining_window):
        super().__init__(model)
        self.s, self.w, self.c = chunk_size, local_window, pretraining_window

    def logits(self, query, keys, first, layer, head):
        s, w, c = self.s, self.w, self.c
        i = torch.arange(first, first + len(query))
        j = torch.arange(len(keys))
        key_positions = j % s
        p_intra = i % s
        p_succ = torch.tensor([s + k if k < w else c - 1 for k in (i % s).tolist()])
        p_inter = torch.full_like(i, c - 1)
        apart = (i // s).unsqueeze(1) - (j // s).unsqueeze(0)
        intra = self.rope_logits(query, keys, p_intra, key_positions)
        succ = self.rope_logits(query, keys, p_succ, key_positions)
        inter = self.rope_logits(query, keys, p_inter, key_positions)
        return torch.where(apart == 0, intra, torch.where(apart == 1, succ, inter))


class NaiveRelative(NaiveLlama):
    """Methods written as a matrix of relative positions: the logit of query i and key j is the query rotated by
    rel(i, j) (one value, or one per frequency) against the key at position 0, pair by pair."""

    def relative(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """(n, T) or (n, T, D/2) relative positions of queries i and keys j (float64)."""
        raise NotImplementedError

    def query_scale(self, i: torch.Tensor) -> torch.Tensor:
        return torch.ones(len(i), dtype=torch.float64)

    def logits(self, query, keys, first, layer, head):
        i = torch.arange(first, first + len(query))
        j = torch.arange(len(keys))
        relative = self.relative(i, j)
        at_zero = self.rope(keys, torch.zeros(len(keys)))
        rows = [(self.rope(q.expand(len(keys), -1) * scale, positions) * at_zero).sum(-1)
                for q, scale, positions in zip(query, self.query_scale(i), relative)]
        return torch.stack(rows) * self.logit_scale(query)


class NaiveReRoPE(NaiveRelative):
    """ReRoPE and Leaky ReRoPE (Su 2023): the distance d = i - j stays d below the window w, becomes w beyond it
    (ReRoPE) or w + (d - w) / k (Leaky ReRoPE, factor k); with log n, query i is scaled by max(1, ln(i+1) / ln(L))."""

    def __init__(self, model, window, factor=None, logn_train_len=None):
        super().__init__(model)
        self.window, self.factor, self.logn_train_len = window, factor, logn_train_len

    def relative(self, i, j):
        d = (i.unsqueeze(1) - j.unsqueeze(0)).double()
        beyond = torch.full_like(d, float(self.window)) if self.factor is None else \
            self.window + (d - self.window) / self.factor
        return torch.where(d < self.window, d, beyond)

    def query_scale(self, i):
        if self.logn_train_len is None:
            return super().query_scale(i)
        return (torch.log(i.double() + 1) / math.log(self.logn_train_len)).clamp(min=1)


class NaiveDPE(NaiveRelative):
    """DPE (Lu et al. 2025): RoPE's frequencies in equal groups, one scale s each. Within the window W every frequency
    sees i - j; beyond it, a frequency of a group with scale s sees (i // s + W - W // s) - j // s."""

    def __init__(self, model, scales, window):
        super().__init__(model)
        half = len(self.inv_freq)
        self.scales = torch.tensor(scales).repeat_interleave(half // len(scales))  # per frequency
        self.window = window

    def relative(self, i, j):
        w, s = self.window, self.scales
        near = (i.unsqueeze(1) - j.unsqueeze(0)).unsqueeze(-1).expand(-1, -1, len(s))
        far = (i.unsqueeze(1).unsqueeze(2) // s + w - w // s) - (j.unsqueeze(0).unsqueeze(2) // s)
        return torch.where(near < w, near, far).double()


class NaiveString(NaiveRelative):
    """STRING (An et al. 2025): the distance d = i - j stays d below the shift S and becomes d - S + W from S on;
    every logit times (1 + 0.1 ln 2)^2 with `scale`, the official code's factor on both the queries' and the keys'
    cos/sin."""

    def __init__(self, model, shift, window, scale=True):
        super().__init__(model)
        self.shift, self.window, self.scale = shift, window, scale

    def relative(self, i, j):
        d = (i.unsqueeze(1) - j.unsqueeze(0)).double()
        return torch.where(d < self.shift, d, d - self.shift + self.window)

    def query_scale(self, i):
        return torch.full((len(i),), (1 + 0.1 * math.log(2)) ** 2 if self.scale else 1.0, dtype=torch.float64)
class NaiveLaMPE(NaiveRelative):
    """LaMPE (arXiv 2508.02308) as its official code (llama_cache1.py) places each key, pair by pair: for N prompt
    tokens, m(x) = floor(U / (N - 1) * x) in float32 as torch computes it; b1 = H - 1 - m(H); R = S, moved on while
    m(R + 1) == m(R); b2 = (N - 1 - R) - m(N - 1 - R) - b1. Distance i - j below H: itself; key j <= i - (N - R):
    (i - b2) - j; any other: m(min(i, N - 1)) + b1 - m(min(j, N - 1)). Below 2H prompt tokens, i - j throughout.
    Every logit times (1 + 0.1 ln 2)^2. The prompt's length is given: decoded tokens keep its map."""

    def __init__(self, model, head, tail, length, prompt_tokens):
        super().__init__(model)
        self.head, self.prompt_tokens = head, prompt_tokens
        # The official map_ids: an int over a long tensor (float32, rounded as torch rounds it), times the indices.
        self.m = torch.floor(length / torch.tensor(prompt_tokens - 1) * torch.arange(prompt_tokens)).long()
        end = tail
        while end + 1 < prompt_tokens and self.m[end] == self.m[end + 1]:
            end += 1
        self.b1 = head - 1 - int(self.m[head]) if prompt_tokens > head else 0
        self.b2 = (prompt_tokens - 1 - end) - int(self.m[prompt_tokens - 1 - end]) - self.b1
        self.tail_end = end

    def relative(self, i, j):
        i, j = i.unsqueeze(1), j.unsqueeze(0)
        d = i - j
        if self.prompt_tokens < 2 * self.head:
            return d.double()
        last = self.prompt_tokens - 1
        middle = self.m[i.clamp(max=last)] + self.b1 - self.m[j.clamp(max=last)]
        tail = (i - self.b2) - j
        far = torch.where(j <= i - (self.prompt_tokens - self.tail_end), tail, middle)
        return torch.where(d < self.head, d, far).double()

    def query_scale(self, i):
        return torch.full((len(i),), (0.1 * math.log(2) + 1) ** 2, dtype=torch.float64)


class NaiveReAttention(NaiveChunked):
    """ReAttention (Liu et al. 2025), one chunk per forward: the first of train_len tokens, then chunks of
    `chunk_size` (Algorithm 1's sizes), one token per forward after. A forward of T <= train_len keys is the plain
    model. Past it, each query head h scores the middle keys [G, T - W) by its un-rotated query against the
    un-rotated keys of head h // group; every (head, query) votes for its `top_keys` best (scores within
    tie * |q| * max |k| of the k-th best tie, the earlier key first); the `clip` most voted (ties: the earlier) each
    bring the keys c - S//2 .. c + S - S//2 - 1 inside the middle; the first G, those and the last W keys sit at
    0..n-1 in order, query i at n - (T - i); every other key is masked."""

    def __init__(self, model, train_len, sink, local_window, top_keys, span, clip, chunk_size, tie):
        super().__init__(model)
        self.tie = tie  # scores within tie * |q| * max |k| of each other are equal: the earlier key wins
        self.train_len, self.sink, self.local_window = train_len, sink, local_window
        self.top_keys, self.span, self.clip, self.chunk_size = top_keys, span, clip, chunk_size

    def best(self, scores: list[float], tolerance: float) -> list[int]:
        """The top_keys scores' indices; scores within `tolerance` of the k-th best tie, the earlier index first."""
        keep = min(self.top_keys, len(scores))
        threshold = sorted(scores, reverse=True)[keep - 1]
        above = [j for j, score in enumerate(scores) if score > threshold + tolerance]
        tied = [j for j, score in enumerate(scores) if threshold - tolerance <= score <= threshold + tolerance]
        return above + tied[: keep - len(above)]

    def prepare(self, queries, keys, first, layer):
        total, heads, kv_heads = len(keys), queries.shape[1], keys.shape[1]
        self.kept = list(range(total))
        if total <= self.train_len:
            return
        middle = range(self.sink, total - self.local_window)
        votes = {}
        for head in range(heads):
            middle_keys = keys[middle.start : middle.stop, head // (heads // kv_heads)]
            largest = float(middle_keys.norm(dim=-1).max())
            for query in queries[:, head]:
                scores = (middle_keys @ query).tolist()
                for index in self.best(scores, self.tie * float(query.norm()) * largest):
                    votes[index] = votes.get(index, 0) + 1
        ranked = sorted(votes, key=lambda index: (-votes[index], index))[: self.clip]
        spans = {min(max(c + offset, 0), len(middle) - 1) for c in ranked
                 for offset in range(-(self.span // 2), self.span - self.span // 2)}
        self.kept = [*range(self.sink), *sorted(middle.start + index for index in spans),
                     *range(middle.stop, total)]

    def logits(self, query, keys, first, layer, head):
        total, n = len(keys), len(self.kept)
        logits = torch.full((len(query), total), float("-inf"), dtype=torch.float64)
        query_positions = torch.arange(first, total) - (total - n)
        logits[:, self.kept] = self.rope_logits(query, keys[self.kept], query_positions, torch.arange(n))
        return logits
