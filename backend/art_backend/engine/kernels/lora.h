// lora_delta: a LoRA adapter's delta, each output summed in one order whatever rows share the step.
// Its loops use int_groups.h's vector type f32xL, kLanes floats wide.

#pragma once

#include "common.h"
#include "int_groups.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// A LoRA adapter's delta (x A^T) B^T for every row of x [rows, in], with a [rank, in] and
// b_t = B^T [rank, out] (B scaled): t = x A^T, then out = sum over k of t[k] b_t[k]. Each output
// is summed in one fixed order whatever the other rows are, so a sequence's tokens do not depend
// on which requests share its step: a BLAS chooses its blocking by the row count, and the same
// row came out ~1e-4 apart alone and beside others, enough to draw another token later.
inline float dot(const float* x, const float* a, int64_t in) {
  f32xL acc[4] = {};
  int64_t i = 0;
  for (; i + 4 * kLanes <= in; i += 4 * kLanes)
    for (int p = 0; p < 4; ++p) {
      f32xL xv, av;
      std::memcpy(&xv, x + i + p * kLanes, sizeof xv);
      std::memcpy(&av, a + i + p * kLanes, sizeof av);
      acc[p] += xv * av;
    }
  const f32xL lanes = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; i < in; ++i) sum += x[i] * a[i];
  return sum;
}

at::Tensor lora_delta(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t) {
  check_float({&x, &a, &b_t}, "lora_delta");
  TORCH_CHECK(a.dim() == 2 && b_t.dim() == 2 && a.size(0) == b_t.size(0) && a.is_contiguous() && b_t.is_contiguous(),
              "lora_delta: a must be contiguous [rank, in] and b_t contiguous [rank, out]");
  const int64_t rank = a.size(0), in = a.size(1), n = b_t.size(1);
  TORCH_CHECK(x.size(-1) == in, "lora_delta: x's last dim must be the adapter's ", in, " inputs");
  const auto x_c = x.contiguous();
  const int64_t rows = x_c.numel() / in;
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, x.options());
  const float *x_p = x_c.data_ptr<float>(), *a_p = a.data_ptr<float>(), *b_p = b_t.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  std::vector<float> t(rows * rank);
  at::parallel_for(0, rows * rank, 8, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) t[j] = dot(x_p + (j / rank) * in, a_p + (j % rank) * in, in);
  });
  // one task per (row, 256 outputs): a single row's delta still spreads over the threads
  constexpr int64_t kColumns = 256;
  const int64_t chunks = (n + kColumns - 1) / kColumns;
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / chunks, first = task % chunks * kColumns, last = std::min(first + kColumns, n);
      float* o = out_p + r * n;
      std::fill(o + first, o + last, 0.f);
      for (int64_t k = 0; k < rank; ++k) {
        const float tk = t[r * rank + k];
        const float* b = b_p + k * n;
        int64_t j = first;
        for (; j + kLanes <= last; j += kLanes) {
          f32xL ov, bv;
          std::memcpy(&ov, o + j, sizeof ov);
          std::memcpy(&bv, b + j, sizeof bv);
          ov += tk * bv;
          std::memcpy(o + j, &ov, sizeof ov);
        }
        for (; j < last; ++j) o[j] += tk * b[j];
      }
    }
  });
  return out;
}

}  // namespace
