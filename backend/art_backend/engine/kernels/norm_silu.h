// add_rms_norm (the residual add and the RMSNorm after it, in one pass) and silu_mul (the MLP's
// SiLU gate).

#pragma once

#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace {

// x <- x + delta (the residual stream, in place); returns x / sqrt(mean(x^2) + eps) * weight.
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_float({&x, &delta, &weight}, "add_rms_norm");
  TORCH_CHECK(x.is_contiguous() && delta.is_contiguous() && weight.is_contiguous() && x.sizes() == delta.sizes(),
              "add_rms_norm: x and delta must be contiguous and the same shape");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  TORCH_CHECK(weight.numel() == n, "add_rms_norm: weight must have x's last dim");
  auto out = at::empty_like(x);
  float *x_p = x.data_ptr<float>(), *out_p = out.data_ptr<float>();
  const float *delta_p = delta.data_ptr<float>(), *w = weight.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x_p + r * n;
      const float* dr = delta_p + r * n;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < n; ++i) {
        xr[i] += dr[i];
        squares += xr[i] * xr[i];
      }
      const float inv = 1.f / std::sqrt(squares / n + static_cast<float>(eps));
      float* o = out_p + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * inv * w[i];
    }
  });
  return out;
}

// gate_up = [gate | up] along the last dim -> silu(gate) * up
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float({&gate_up}, "silu_mul");
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "silu_mul: a contiguous [..., 2 * n] input");
  const int64_t n = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * n);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, gate_up.options());
  const float* in_p = gate_up.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *gate = in_p + r * 2 * n, *up = gate + n;
      float* o = out_p + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = gate[i] / (1.f + exp_simd(-gate[i])) * up[i];
    }
  });
  return out;
}

}  // namespace
