"""A lean inference forward for Llama-family decoders (Llama, SmolLM2, Qwen2, Qwen3).

Why not `model.generate`: one decode step of a 135M model in transformers spends most of its
time outside the arithmetic it needs (DESIGN.md). This forward keeps only the arithmetic: fused
q/k/v and gate/up projections, rotary embeddings from a precomputed table applied to q and k
at once, and a KV cache indexed by slot, so one step is ~15 torch ops per layer for the whole
batch.

On CPU the frozen weights are reordered once into oneDNN's blocked layout: at decode batch
sizes (1-16 rows) those matmuls take about half the time of `F.linear`'s MKL path, at the same
precision (fp32 sums in another order, ~1e-6 apart). The copies are the engine's own; the
trainer keeps the Hugging Face model.

`dtype=torch.bfloat16` (opt-in on CPU, the default on GPU) keeps those weights in bf16 and
multiplies bf16 inputs, ~1.2x faster end to end on CPUs with AVX512-BF16 or AMX; norms,
attention and the residual stream stay in the model's dtype. Sampled logprobs then differ from
the fp32 trainer's by ~0.03 nats on average (KL ~7e-4 per token on the embedded model); they
are still the sampler's own, and the loss's importance ratio absorbs the difference.

On CPU in float32, every token runs the fused kernels of `cpu_kernels.cpp`: rotary embedding,
KV-cache write and attention in one call per layer, each residual add fused with the norm after
it. A decode step is ~1.25x faster this way than with eager torch ops. A prompt runs them too,
its tokens as rows: a token's numbers are then the same whether it came in a prompt, from a
cached prefix or from a decode step, and each row's sums run in an order no other row changes,
so a seeded request draws the same tokens whichever requests share the engine with it. The eager
torch ops stay for other devices and machines without a C++ compiler.
Weights that are exactly small integers in groups, as the embedded model's GGUF weights are,
are kept as such and multiplied by `linear_groups` (exact_groups.py): a 16-row step of the
embedded model then reads ~100 MB of weights instead of ~540 MB, and takes ~0.6x the time.

LoRA adapters are applied unmerged, per row: row b of a batch adds
scale * (x A_b^T) B_b^T, where A_b, B_b belong to that row's adapter (on CPU, `lora_delta`: per
row, as above). An adapter may also carry
merged weights, W + scale * B A packed like the base ones: a batch whose rows all use it (a
rollout step) then costs what the base model costs, at the price of a dense copy of the
adapted projections. Over exact integer groups the engine does not merge: the groups plus the
unmerged delta are faster than a merged float32 copy.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from art_backend.engine.cpu_kernels import load_cpu_kernels, vector_build
from art_backend.engine.exact_groups import as_exact_groups
from art_backend.engine.kv_cache import KVCache

logger = logging.getLogger(__name__)

# the forward's fused projections and the Hugging Face modules each one stacks, in order
PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
               "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
_BLOCK_OF = {"qkv": "self_attn", "o": "self_attn", "gate_up": "mlp", "down": "mlp"}  # where those modules live
LORA_TARGETS = tuple(module for modules in PROJECTIONS.values() for module in modules)


@dataclass
class LoraWeights:
    """One adapter, per (layer, fused projection): A [R, in] stacks the A of every target module
    in it and B [out, R] is block-diagonal with their scaled B, so one pair of matmuls gives the
    whole projection's delta (a module the adapter lacks is a zero block). B is kept transposed,
    `b_t` [R, out], the layout in which `lora_delta` reads it."""

    a: dict[tuple[int, str], Tensor]
    b_t: dict[tuple[int, str], Tensor]
    merged: list[dict[str, FrozenLinear]] | None = None  # per layer, from `LeanLlama.merge`
    source: Path | None = None  # the adapter directory it was read from


# the adapters of a batch's rows: each with the rows it serves (None: all of them)
AdapterRows = list[tuple[LoraWeights, Tensor | None]]


# A batch-size hint for oneDNN's reorder: decode batches; other sizes run correctly too.
_PACKED_FOR_ROWS = 16


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU build multiplies oneDNN-packed `dtype` weights correctly (tried once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    weight, x = torch.randn(8, 16).to(dtype), torch.randn(3, 16).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKED_FOR_ROWS)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError as error:
        logger.warning("oneDNN weight packing unavailable for %s (%s); serving with F.linear", dtype, error)
        return False
    if not torch.allclose(out.float(), F.linear(x, weight).float(), atol=0.1, rtol=0.05):
        logger.warning("oneDNN packed %s matmuls disagree with F.linear on this CPU; serving with F.linear", dtype)
        return False
    return True


class FrozenLinear:
    """y = x W^T + b with W frozen, stored in the fastest layout this device multiplies in `dtype`:
    exact integer groups for `kernels.linear_groups` where W is such groups (exact_groups.py), else
    oneDNN's blocked layout, else as is."""

    def __init__(self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, kernels: Any | None = None) -> None:
        self.dtype = dtype
        weight = weight.detach().to(dtype)
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.kernels = kernels
        self.groups = as_exact_groups(weight) if kernels is not None and weight.device.type == "cpu" else None
        self.packed = self.groups is None and weight.device.type == "cpu" and onednn_packs(dtype)
        if self.groups is not None:
            self.weight = None  # the groups are the weight; no float32 copy is kept
        else:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKED_FOR_ROWS) if self.packed else weight

    def __call__(self, x: Tensor) -> Tensor:
        inputs = x if x.dtype is self.dtype else x.to(self.dtype)  # `is`: a decode step makes ~120 of these calls
        if self.groups is not None:
            groups = self.groups
            out = self.kernels.linear_groups(inputs, groups.codes, groups.scales, groups.offsets, self.bias, groups.bits)
        elif self.packed:
            out = torch.ops.mkldnn._linear_pointwise(inputs, self.weight, self.bias, "none", [], "")
        else:
            out = F.linear(inputs, self.weight, self.bias)
        return out if out.dtype is x.dtype else out.to(x.dtype)


class LeanLlama:
    def __init__(self, model: torch.nn.Module, max_len: int, dtype: torch.dtype | None = None,
                 fused_kernels: bool = True) -> None:
        """`dtype`: the frozen weights' and matmuls' dtype; None keeps the model's.
        `fused_kernels`: decode with `cpu_kernels.cpp` where it applies (CPU, float32)."""
        cfg = model.config
        if cfg.model_type not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ValueError(
                f"The embedded engine runs Llama-family models (llama, qwen2, qwen3, mistral); "
                f"{cfg.model_type!r} is not supported. Use the vLLM engine for other architectures."
            )
        inner = model.model
        self.config = cfg
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        self.dtype = self.embed.dtype  # activations, norms, attention and the KV cache
        self.device = self.embed.device
        self.weights_dtype = dtype or self.dtype
        applies = fused_kernels and self.device.type == "cpu" and self.dtype == torch.float32
        self.kernels = load_cpu_kernels() if applies else None  # None: eager torch ops throughout
        self.norm = inner.norm.weight
        # exact integer groups where the kernel keeps a block of rows' sums in vector registers;
        # a plain SSE build keeps the float32 layout
        group_kernels = self.kernels if vector_build() else None
        self.lm_head = FrozenLinear(model.get_output_embeddings().weight, None, self.weights_dtype, group_kernels)
        # the model's own Linear modules: peft later wraps them for training but keeps these
        # objects (and their frozen weights) as its base layers, so `merge` can re-read them
        self._modules = [{projection: [getattr(getattr(layer, _BLOCK_OF[projection]), name) for name in names]
                          for projection, names in PROJECTIONS.items()} for layer in inner.layers]
        self.norms: list[dict[str, Tensor | None]] = [
            {"ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
             "q_norm": getattr(getattr(layer.self_attn, "q_norm", None), "weight", None),
             "k_norm": getattr(getattr(layer.self_attn, "k_norm", None), "weight", None)}
            for layer in inner.layers]
        with torch.no_grad():
            self.linears = [{projection: FrozenLinear(*self._fused(i, projection), self.weights_dtype, group_kernels)
                             for projection in PROJECTIONS} for i in range(len(inner.layers))]
        rotary = inner.rotary_emb
        positions = torch.arange(max_len, device=self.device)[None]
        with torch.no_grad():
            dummy = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = rotary(dummy, positions)
        self.cos, self.sin = cos[0], sin[0]  # [max_len, head_dim]
        self.max_len = max_len
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim

    def _frozen_linears(self) -> list[FrozenLinear]:
        return [self.lm_head, *(linear for layer in self.linears for linear in layer.values())]

    @property
    def grouped_matrices(self) -> int:
        """How many weight matrices are served as exact integer groups (`linear_groups`)."""
        return sum(linear.groups is not None for linear in self._frozen_linears())

    def weights_layout(self) -> str:
        """The serving weights' dtype, and how many matrices are exact integer groups, for the log."""
        dtype = str(self.weights_dtype).removeprefix("torch.")
        grouped = self.grouped_matrices
        return f"{dtype}, {grouped} of {len(self._frozen_linears())} matrices as exact integer groups" if grouped else dtype

    def _fused(self, layer: int, projection: str) -> tuple[Tensor, Tensor | None]:
        """A fused projection's weight [out, in] and bias (None unless every module has one)."""
        modules = self._modules[layer][projection]
        biases = [module.bias for module in modules]
        bias = None if any(b is None for b in biases) else torch.cat(biases).detach()
        return torch.cat([module.weight for module in modules]).detach(), bias

    @torch.no_grad()
    def merge(self, lora: LoraWeights) -> list[dict[str, FrozenLinear]]:
        """Per layer, the fused projections with `lora` added (W + B A), in the base weights'
        layout; projections the adapter lacks are the base ones, shared."""
        merged = []
        for i, base in enumerate(self.linears):
            linears = {}
            for projection in PROJECTIONS:
                key = (i, projection)
                if key in lora.a:
                    weight, bias = self._fused(i, projection)
                    linears[projection] = FrozenLinear(weight + lora.b_t[key].T @ lora.a[key], bias, self.weights_dtype)
                else:
                    linears[projection] = base[projection]
            merged.append(linears)
        return merged

    def new_cache(self) -> KVCache:
        return KVCache(len(self.linears), self.n_kv, self.head_dim, self.dtype, self.device)

    def _rms(self, x: Tensor, w: Tensor | None) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    @staticmethod
    def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def fuse_lora(self, a: dict[tuple[int, str], Tensor], b: dict[tuple[int, str], Tensor]) -> LoraWeights:
        """`a`, `b`: per (layer, module) A [r, in] and scaled B [out, r] -> per fused projection."""
        inter = self.config.intermediate_size
        out_size = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size,
                    "o_proj": self.config.hidden_size, "gate_proj": inter, "up_proj": inter,
                    "down_proj": self.config.hidden_size}
        fused_a: dict[tuple[int, str], Tensor] = {}
        fused_b: dict[tuple[int, str], Tensor] = {}
        for layer in range(len(self.linears)):
            for projection, modules in PROJECTIONS.items():
                present = [m for m in modules if (layer, m) in a]
                if not present:
                    continue
                fused_a[(layer, projection)] = torch.cat([a[(layer, m)] for m in present])
                block = torch.zeros(sum(out_size[m] for m in modules), sum(a[(layer, m)].shape[0] for m in present),
                                    dtype=self.dtype, device=self.device)
                row = col = 0
                for module in modules:
                    if module in present:
                        part = b[(layer, module)]
                        block[row:row + part.shape[0], col:col + part.shape[1]] = part
                        col += part.shape[1]
                    row += out_size[module]
                fused_b[(layer, projection)] = block.T.contiguous()
        return LoraWeights(fused_a, fused_b)

    def _delta(self, x: Tensor, adapter: LoraWeights, key: tuple[int, str]) -> Tensor:
        """(x A^T) B^T; with the CPU kernels, each row's sums in an order no other row changes."""
        if self.kernels is not None:
            return self.kernels.lora_delta(x, adapter.a[key], adapter.b_t[key])
        return (x @ adapter.a[key].T) @ adapter.b_t[key]

    def _adapter_rows(self, lora: list[LoraWeights | None]) -> AdapterRows:
        """Each adapter of `lora` (one entry per row) with its rows; None for the rows when it has
        them all (a rollout step: no gather or scatter). Found once per forward, not per projection."""
        rows: dict[int, tuple[LoraWeights, list[int]]] = {}
        for row, adapter in enumerate(lora):
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].append(row)
        return [(adapter, None if len(taken) == len(lora) else torch.tensor(taken, device=self.device))
                for adapter, taken in rows.values()]

    def _lora(self, x: Tensor, key: tuple[int, str], adapters: AdapterRows) -> Tensor | None:
        """Per-row LoRA deltas for one fused projection, or None where no row's adapter has it."""
        delta = None
        for adapter, rows in adapters:
            if key not in adapter.a:
                continue
            if rows is None:
                return self._delta(x, adapter, key)
            d = self._delta(x[rows], adapter, key)
            if delta is None:
                delta = x.new_zeros(*x.shape[:-1], d.shape[-1])
            delta[rows] = d
        return delta

    def _project(self, x: Tensor, linear: FrozenLinear, layer: int, projection: str,
                 adapters: AdapterRows | None) -> Tensor:
        out = linear(x)
        delta = None if adapters is None else self._lora(x, (layer, projection), adapters)
        return out if delta is None else out + delta

    @torch.no_grad()
    def forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, cache: KVCache,
                lengths: Tensor, lora: list[LoraWeights | None] | None = None,
                shared: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Run `tokens` [B, T] at `positions` [B, T], writing K/V into cache `slots` [B].

        `lengths` [B] is each row's total length after this call (attention spans
        positions < length, causally). Returns final hidden states [B, T, hidden]; use
        `logits()` on the rows needed. Rows of a multi-token call must share one slot range
        layout: row b attends to cache slot slots[b] only.
        `shared` (slots [B], lengths [B]), one token per row: row b's slot holds the same first
        lengths[b] keys and values as slot slots[b] (the same tokens and adapter); the fused
        kernels read them there, where rows sharing them read them once from memory. The eager
        ops read each row's own copy.
        """
        linears = self.linears
        if lora is not None and lora[0] is not None:
            adapter, merged = lora[0], lora[0].merged  # read once: a load may set it meanwhile
            if merged is not None and all(a is adapter for a in lora):
                linears, lora = merged, None  # one merged adapter for the whole batch
        batch, steps = tokens.shape
        if self.kernels is not None:  # every token a row of the fused step
            rows = None if lora is None else self._adapter_rows([adapter for adapter in lora for _ in range(steps)])
            if shared is not None and steps != 1:
                raise ValueError(f"`shared` applies to one token per row; this call has {steps}")
            hidden = self._decode_fused(tokens.reshape(-1), positions.reshape(-1),
                                        slots.repeat_interleave(steps), cache, linears, rows, shared)
            return hidden.view(batch, steps, -1)
        adapters = None if lora is None else self._adapter_rows(lora)
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]  # [B,T,1,hd]
        span = int(lengths.max())
        key_pos = torch.arange(span, device=self.device)
        # mask[b, 0, t, j]: key j visible to query t of row b (causal, within the row's length)
        mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]
        contiguous = bool(torch.equal(slots, torch.arange(batch, device=slots.device)))
        rows = slots[:, None].expand(batch, steps)
        heads = self.n_heads + self.n_kv
        for i, (norms, linear) in enumerate(zip(self.norms, linears)):
            h = self._rms(x, norms["ln1"])
            qkv = self._project(h, linear["qkv"], i, "qkv", adapters)
            qk = qkv[..., : self.q_size + self.kv_size].view(batch, steps, heads, self.head_dim)
            v = qkv[..., self.q_size + self.kv_size:].view(batch, steps, self.n_kv, self.head_dim)
            if norms["q_norm"] is not None:
                q, k = qk.split((self.n_heads, self.n_kv), dim=2)
                qk = torch.cat((self._rms(q, norms["q_norm"]), self._rms(k, norms["k_norm"])), dim=2)
            q, k = self._rope(qk, cos, sin).split((self.n_heads, self.n_kv), dim=2)  # [B, T, heads, hd]
            # advanced indexing on (slot, position) puts those dims first: [B, T, kv, hd]
            cache.k[i][rows, :, positions] = k
            cache.v[i][rows, :, positions] = v
            if contiguous:
                keys, values = cache.k[i][:batch, :, :span], cache.v[i][:batch, :, :span]
            else:
                keys, values = cache.k[i][slots, :, :span], cache.v[i][slots, :, :span]
            att = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
            att = att.transpose(1, 2).reshape(batch, steps, self.q_size)
            x = x + self._project(att, linear["o"], i, "o", adapters)
            h = self._rms(x, norms["ln2"])
            gate, up = self._project(h, linear["gate_up"], i, "gate_up", adapters).chunk(2, dim=-1)
            x = x + self._project(F.silu(gate) * up, linear["down"], i, "down", adapters)
        return self._rms(x, self.norm)

    def _decode_fused(self, tokens: Tensor, positions: Tensor, slots: Tensor, cache: KVCache,
                      linears: list[dict[str, FrozenLinear]], adapters: AdapterRows | None,
                      shared: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """`forward` for one token per row (`tokens`, `positions`, `slots` [N]), in 6 ops per layer."""
        kernels, batch = self.kernels, tokens.shape[0]
        x = F.embedding(tokens, self.embed)  # the residual stream [B, hidden], updated in place
        cos, sin = self.cos[positions], self.sin[positions]
        h = self._rms(x, self.norms[0]["ln1"])
        norms_after = [norms["ln1"] for norms in self.norms[1:]] + [self.norm]  # each layer's output norm
        shared_slots, shared_lengths = shared if shared is not None else (None, None)
        for i, (norms, linear, norm_after) in enumerate(zip(self.norms, linears, norms_after)):
            qkv = self._project(h, linear["qkv"], i, "qkv", adapters).view(batch, -1, self.head_dim)
            q, k, v = qkv.split_with_sizes((self.n_heads, self.n_kv, self.n_kv), dim=1)
            if norms["q_norm"] is not None:
                q, k = self._rms(q, norms["q_norm"]), self._rms(k, norms["k_norm"])
            att = kernels.decode_attention(q, k, v, cos, sin, cache.k[i], cache.v[i], slots, positions,
                                           shared_slots, shared_lengths)
            h = kernels.add_rms_norm(x, self._project(att.view(batch, -1), linear["o"], i, "o", adapters),
                                     norms["ln2"], self.eps)
            up = kernels.silu_mul(self._project(h, linear["gate_up"], i, "gate_up", adapters))
            h = kernels.add_rms_norm(x, self._project(up, linear["down"], i, "down", adapters), norm_after, self.eps)
        return h[:, None]

    @torch.no_grad()
    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()
