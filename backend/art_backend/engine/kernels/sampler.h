// sample_tokens and gumbel_argmax: the seeded Gumbel-max draw of vLLM's CPU sampler, copied so
// that a seeded request draws the same tokens on both engines.

#pragma once

#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// The Gumbel-max draw of vLLM's CPU sampler (its `fused_gumbel_argmax`), so that a seeded request
// samples the same tokens on both engines: token i of a row with seed s gets the noise
// g_i = -log(-log u_i), u_i = (splitmix64(splitmix64(s) + (i + 1) * golden) >> 11 + 1/2) / 2^53,
// and the row draws argmax_i (double(scaled_i) + g_i), the first on a tie. Drawing one token per
// row this way samples softmax(scaled) exactly.
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

inline double noise_uniform(uint64_t key, int64_t i) {
  return (static_cast<double>(splitmix64(key + static_cast<uint64_t>(i + 1) * kGolden) >> 11) + 0.5) * 0x1.0p-53;
}

// The argmax above, evaluating the two logs for few tokens. `weights[i]` ~ exp(scaled_i -
// scaled_top) (~0 where masked: such a token, if evaluated, totals -inf), `top` a token of the
// largest scaled logit. Its total B = scaled_top + g_top is reached, so a winner i has
// g_i >= B - scaled_i, that is -log u_i <= exp(scaled_i - B) = weights[i] exp(-g_top); and as
// -log u >= 1 - u, a token with 1 - u_i above that (with a margin for the weights' rounding)
// cannot win. Every other token is evaluated exactly, so the result is the full argmax's.
template <typename Scaled>
int64_t gumbel_argmax_row(Scaled scaled, const float* weights, int64_t vocab, int64_t top, uint64_t seed) {
  const uint64_t key = splitmix64(seed);
  int64_t best = top;
  double best_total = static_cast<double>(scaled(top)) - std::log(-std::log(noise_uniform(key, top)));
  const double reach = std::exp(static_cast<double>(scaled(top)) - best_total) * 1.001;  // exp(-g_top), margin
  for (int64_t i = 0; i < vocab; ++i) {
    const double u = noise_uniform(key, i);
    if (i == top || 1.0 - u > weights[i] * reach + 0x1.0p-50) continue;
    const double total = static_cast<double>(scaled(i)) - std::log(-std::log(u));
    if (total > best_total || (total == best_total && i < best)) {
      best = i;
      best_total = total;
    }
  }
  return best;
}

// Row b of `scaled` [batch, vocab] (logits over temperature, -inf where masked): its Gumbel-max
// draw with seed `seeds[b]`, as vLLM's CPU sampler draws it.
at::Tensor gumbel_argmax(const at::Tensor& scaled, const at::Tensor& seeds) {
  check_float({&scaled}, "gumbel_argmax");
  TORCH_CHECK(scaled.dim() == 2 && scaled.is_contiguous(), "gumbel_argmax: scaled must be contiguous [batch, vocab]");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.numel() == scaled.size(0), "gumbel_argmax: one int64 seed per row");
  const int64_t batch = scaled.size(0), vocab = scaled.size(1);
  const auto seeds_c = seeds.contiguous();
  auto tokens = at::empty({batch}, seeds.options());
  const float* in_p = scaled.data_ptr<float>();
  const int64_t* seed_p = seeds_c.data_ptr<int64_t>();
  int64_t* token_p = tokens.data_ptr<int64_t>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(vocab);
    for (int64_t b = begin; b < end; ++b) {
      const float* row = in_p + b * vocab;
      const int64_t top = std::max_element(row, row + vocab) - row;
      const float peak = row[top];
      if (peak == -std::numeric_limits<float>::infinity()) {  // nothing allowed: vLLM's kernel gives 0
        token_p[b] = 0;
        continue;
      }
#pragma omp simd
      for (int64_t j = 0; j < vocab; ++j) weights[j] = exp_simd(row[j] - peak);
      token_p[b] = gumbel_argmax_row([row](int64_t i) { return row[i]; }, weights.data(), vocab, top,
                                     static_cast<uint64_t>(seed_p[b]));
    }
  });
  return tokens;
}

// Row b of `logits` [batch, vocab]: a token drawn from softmax(logits[b] / t) with seed
// `seeds[b]` (the Gumbel-max draw above), t = temperature[b] (0: the argmax, scored at t = 1),
// and its logprob log_softmax(logits[b] / t)[token]. One pass computes the exps, which are both
// the logprob's sum and the draw's weights. The sum is in double: over ~50k terms a float sum
// would drift by ~1e-3.
std::tuple<at::Tensor, at::Tensor> sample_tokens(const at::Tensor& logits, const at::Tensor& temperature,
                                                 const at::Tensor& seeds) {
  check_float({&logits, &temperature}, "sample_tokens");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "sample_tokens: logits must be contiguous [batch, vocab]");
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(temperature.numel() == batch && seeds.numel() == batch && seeds.scalar_type() == at::kLong,
              "sample_tokens: one temperature and one int64 seed per row");
  const auto temperature_c = temperature.contiguous(), seeds_c = seeds.contiguous();
  auto tokens = at::empty({batch}, logits.options().dtype(at::kLong));
  auto logprobs = at::empty({batch}, logits.options());
  const float *in_p = logits.data_ptr<float>(), *t_p = temperature_c.data_ptr<float>();
  const int64_t* seed_p = seeds_c.data_ptr<int64_t>();
  int64_t* token_p = tokens.data_ptr<int64_t>();
  float* logprob_p = logprobs.data_ptr<float>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> exps(vocab);
    for (int64_t b = begin; b < end; ++b) {
      const float* row = in_p + b * vocab;
      const bool greedy = t_p[b] == 0.f;
      const float t = greedy ? 1.f : t_p[b], inv_t = 1.f / t;
      const int64_t top = std::max_element(row, row + vocab) - row;
      const float peak = row[top];
      double sum = 0.0;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < vocab; ++j) {
        exps[j] = exp_simd((row[j] - peak) * inv_t);
        sum += exps[j];
      }
      // scaled as vLLM's sampler scales: a float division by the temperature
      const int64_t token = greedy ? top : gumbel_argmax_row([row, t](int64_t i) { return row[i] / t; }, exps.data(),
                                                             vocab, top, static_cast<uint64_t>(seed_p[b]));
      token_p[b] = token;
      logprob_p[b] = (row[token] - peak) * inv_t - static_cast<float>(std::log(sum));
    }
  });
  return {tokens, logprobs};
}

}  // namespace
