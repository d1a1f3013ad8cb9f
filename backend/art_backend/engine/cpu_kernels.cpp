// Fused float32 kernels for LeanLlama's CPU decode step (one new token per row).
//
// At decode batch sizes the step's matmuls stream their weights at the memory-bandwidth limit;
// what is left between them is ~20 small torch ops per layer, each a dispatch and a pass over
// memory. Three ops here replace them, a fourth draws the next tokens (a fifth, the draw alone),
// a sixth multiplies weights stored as exact integer groups, which cuts the bytes those matmuls
// stream, and a seventh adds a LoRA adapter's delta row by row. Built by cpu_kernels.py; each has
// an eager twin (llama.py, sampling.py, float64) that the tests compare it with.
//
// One translation unit (one compile in the JIT build); the ops live in kernels/ by subject:
// common.h (the vectorizable exp, the inputs' check), attention.h (decode_attention),
// norm_silu.h (add_rms_norm, silu_mul), int_groups.h (linear_groups), lora.h (lora_delta) and
// sampler.h (sample_tokens, gumbel_argmax). This file registers them with torch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/common.h"
#include "kernels/attention.h"
#include "kernels/norm_silu.h"
#include "kernels/int_groups.h"
#include "kernels/lora.h"
#include "kernels/sampler.h"

TORCH_LIBRARY(art_cpu_kernels, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slots, Tensor positions, Tensor? shared_slots=None, "
        "Tensor? shared_lengths=None) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("sample_tokens(Tensor logits, Tensor temperature, Tensor seeds) -> (Tensor, Tensor)");
  m.def("gumbel_argmax(Tensor scaled, Tensor seeds) -> Tensor");
  m.def("linear_groups(Tensor x, Tensor codes, Tensor scales, Tensor offsets, Tensor? bias, int bits) -> Tensor");
  m.def("lora_delta(Tensor x, Tensor a, Tensor b_t) -> Tensor");
}

TORCH_LIBRARY_IMPL(art_cpu_kernels, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("sample_tokens", sample_tokens);
  m.impl("gumbel_argmax", gumbel_argmax);
  m.impl("linear_groups", linear_groups);
  m.impl("lora_delta", lora_delta);
}
