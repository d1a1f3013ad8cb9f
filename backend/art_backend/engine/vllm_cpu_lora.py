"""vLLM's LoRA on CPU, one matmul per adapter in the batch instead of one matrix copy per token.

vLLM applies LoRA on CPU with its PyTorch-native punica ops (`vllm/lora/ops/torch_ops`). Each
gathers every token's adapter matrix, `weights[indices]` (tokens x out x rank floats), and
contracts it with an einsum, so a prefill of 1,600 tokens copies 1,600 matrices per projection
slice: on one core of a Xeon, 18.7 ms (A, 576 -> 8) and 92 ms (B, 8 -> 1536) against 0.5 and
1.2 ms for the same products as matmuls, and rollouts with an adapter ran 4.4 times as long as
without (`benchmarks/bench_vllm_lora_cpu.py`). The products are the same whichever way they are
taken:

    out[t] = x[t] @ W[indices[t]].T     for every token t
           = (x[rows] @ W[slot].T)       for the rows of each adapter slot present

so the ops below group the tokens by slot (one slot, the usual case, is one matmul) and keep
everything else about vLLM's ops: their signatures, the output dtype, how they add or overwrite.
One thing they change: a token of a request without an adapter (index -1, "no LoRA" to vLLM's
GPU kernels, which skip it) adds nothing, where the gather read -1 as Python does, the last slot:
with every slot holding an adapter, the base model's requests batched beside them were served
with the last one. Installed in each worker process through `vllm_worker.py` once vLLM has
started; vLLM's LoRA layers look the ops up at each call, so every later step uses these.
"""

from __future__ import annotations

from typing import Any

import torch

_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
NO_ADAPTER = -1  # vLLM's index for a token of a request without one


def _per_token_products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """`inputs[t] @ weights[indices[t]].T` for each token t, in `dtype`; zero where indices[t] is -1."""
    if weights.dim() == 4:  # (slots, 1, out, in): vLLM's stacked layout
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    if indices.numel() and bool((indices == indices[0]).all()) and int(indices[0]) != NO_ADAPTER:
        return inputs @ weights[indices[0]].to(dtype).T
    products = inputs.new_zeros((inputs.shape[0], weights.shape[1]))
    for slot in indices.unique().tolist():
        if slot != NO_ADAPTER:
            rows = indices == slot
            products[rows] = inputs[rows] @ weights[slot].to(dtype).T
    return products


def bgmv_shrink(inputs: torch.Tensor, lora_a_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    products = _per_token_products(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : products.shape[1]] = scaling * products


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    products = _per_token_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    # as vLLM's op: one row broadcast over a batch, and the shorter of the two paddings
    limit = 1 if products.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    width = min(products.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :width] += products[:limit, :width]
    else:
        output_tensor[:, :width] = products[:limit, :width]


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    products = _per_token_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += products
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = products


_vllms_own: dict[tuple[Any, str], Any] = {}


def install(grouped: bool = True) -> bool:
    """Put the grouped ops in this process's vLLM on CPU (its sgmv ops call the bgmv ones), or
    vLLM's own back (`grouped=False`, for benchmarks/bench_vllm_lora_cpu.py); False where vLLM is
    on a GPU or its CPU ops are not the ones this was written for (`VLLMEngine` warns on CPU)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    modules: tuple[Any, ...] = (lora_ops, punica_cpu)
    if not all(callable(getattr(module, name, None)) for module in modules for name in _OPS):
        return False
    for module in modules:
        for name in _OPS:
            _vllms_own.setdefault((module, name), getattr(module, name))
            setattr(module, name, globals()[name] if grouped else _vllms_own[module, name])
    return True
