// What every op of cpu_kernels.cpp uses: `exp_simd`, an exp that `omp simd` loops vectorize,
// and `check_float`, the check that an op's inputs are float32 CPU tensors.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace {

// exp(x) for float32, written so that `omp simd` loops vectorize it (std::exp stays a scalar
// libm call per element, and the softmax and SiLU are mostly exps): exp(x) = 2^n exp(r) with
// n = round(x / ln 2), r = x - n ln 2 in two parts, and Cephes' degree-6 polynomial for exp(r)
// on |r| <= ln(2)/2 (relative error ~1e-7, like libm's). Inputs are clamped to float's range.
// (The clamps vectorize as compares and blends only under -fno-trapping-math.)
inline float exp_simd(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.37f ? 88.37f : x;  // below log(FLT_MAX) with n <= 127, so 2^n stays finite
  const float shifted = x * 1.44269504f + 12582912.0f;  // adding 1.5 * 2^23 rounds to an integer
  const float n = shifted - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t exponent = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, built in the exponent bits
  float power;
  std::memcpy(&power, &exponent, sizeof power);  // not std::bit_cast: C++20, and older torch builds extensions as C++17
  return p * power;
}

void check_float(std::initializer_list<const at::Tensor*> tensors, const char* op) {
  for (const auto* t : tensors)
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), op, ": inputs must be float32 CPU tensors");
}

}  // namespace
