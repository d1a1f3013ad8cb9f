// decode_attention: a decode step's rotary embedding, KV-cache write and grouped-query attention
// in one op, with the AVX-512 / AVX2 code that the common head sizes take.

#pragma once

#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

// out = (x * cos + rotate_half(x) * sin) * scale, with rotate_half(x) = (-x[half:], x[:half]):
// Hugging Face's rotary embedding, cos and sin holding `d` entries (each half repeated).
inline void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t d, float scale) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    out[i] = (x[i] * cos[i] - x[i + half] * sin[i]) * scale;
    out[i + half] = (x[i + half] * cos[i + half] + x[i] * sin[i + half]) * scale;
  }
}

// One KV head's keys and values [length, d] as a row reads them: positions below `split` from
// the slot of a row it shares them with (the same tokens, so the same numbers: see
// `decode_attention`), the rest from its own slot.
struct HeadKV {
  const float *shared_keys, *shared_values, *keys, *values;
  int64_t split;
  const float* key(int64_t j, int64_t d) const { return (j < split ? shared_keys : keys) + j * d; }
  const float* value(int64_t j, int64_t d) const { return (j < split ? shared_values : values) + j * d; }
};

// Each of `group` rows of `scores` [group, length] -> exp(score - the row's max), their sums in `total`
void softmax_numerators(float* scores, int64_t group, int64_t length, float* total) {
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * length;
    const float top = *std::max_element(row, row + length);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < length; ++j) {
      row[j] = exp_simd(row[j] - top);
      sum += row[j];
    }
    total[g] = sum;
  }
}

// Scores, softmax numerators and their sums: for each query g of a KV head's group,
//   scores[g, j] = query_g . key_j,  then exp(scores[g, j] - max_j), total[g] = their sum,
//   acc[g] = sum_j exp(...) value_j  (the output before dividing by total[g]).
// Portable loops: one dot product per (key, query), each ending in a sum across the vector.
void attend_loops(const float* queries, int64_t group, const HeadKV& kv, int64_t length, int64_t d, float* scores,
                  float* acc, float* total) {
  for (int64_t j = 0; j < length; ++j) {
    const float* key = kv.key(j, d);
    for (int64_t g = 0; g < group; ++g) {
      const float* query = queries + g * d;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += query[i] * key[i];
      scores[g * length + j] = dot;
    }
  }
  softmax_numerators(scores, group, length, total);
  std::fill(acc, acc + group * d, 0.f);
  for (int64_t j = 0; j < length; ++j) {
    const float* value = kv.value(j, d);
    for (int64_t g = 0; g < group; ++g) {
      const float weight = scores[g * length + j];
      float* a = acc + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] += weight * value[i];
    }
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
// accumulators `weigh_values` keeps in registers: of AVX-512's 32, or AVX2's 16 (the rest hold
// a weight and a load)
constexpr int kSums = 12;

// The vector operations the attention below needs, on AVX-512's 16 floats or AVX2's 8
#ifdef __AVX512F__
struct Vec {
  using T = __m512;
  static constexpr int kLanes = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T broadcast(float x) { return _mm512_set1_ps(x); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static void store_first(float* p, T v, int64_t n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v); }

  // [sum of v[0]'s 16 lanes, ..., sum of v[15]'s]: pairs of vectors folded into one, four times
  // over (each fold adds halves of two vectors' lanes), 48 instructions for 16 sums where 16
  // separate sums across a vector take ~130 and wait on each other.
  static T sum_each(const T* v) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
      pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: its sums of four vectors
      const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
      quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);  // 128-bit lanes 0, 2 and 1, 3
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], kEven),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], kOdd));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], kEven),
                                      _mm512_shuffle_f32x4(quads[2], quads[3], kOdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, kEven), _mm512_shuffle_f32x4(low, high, kOdd));
  }
};
#else
struct Vec {
  using T = __m256;
  static constexpr int kLanes = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T broadcast(float x) { return _mm256_set1_ps(x); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static void store_first(float* p, T v, int64_t n) {
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), v);
  }

  // [sum of v[0]'s 8 lanes, ..., sum of v[7]'s], each lane after lane as GCC ends an `omp simd`
  // sum (so the dot products round as `attend_loops`' do): the 8 x 8 block transposed, its rows added.
  static T sum_each(const T* v) {
    T pairs[8], quads[8];
    for (int i = 0; i < 4; ++i) {  // per 128-bit half: [v[2i] l0, v[2i+1] l0, v[2i] l1, v[2i+1] l1] and l2, l3
      pairs[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
      pairs[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i)  // per half: one lane of four vectors
      for (int j = 0; j < 2; ++j) {
        quads[4 * i + 2 * j] = _mm256_shuffle_ps(pairs[4 * i + j], pairs[4 * i + j + 2], _MM_SHUFFLE(1, 0, 1, 0));
        quads[4 * i + 2 * j + 1] = _mm256_shuffle_ps(pairs[4 * i + j], pairs[4 * i + j + 2], _MM_SHUFFLE(3, 2, 3, 2));
      }
    T sum = _mm256_permute2f128_ps(quads[0], quads[4], 0x20);  // lane 0 of all eight
    for (int lane = 1; lane < 8; ++lane)
      sum = _mm256_add_ps(sum, _mm256_permute2f128_ps(quads[lane % 4], quads[4 + lane % 4], lane < 4 ? 0x20 : 0x31));
    return sum;
  }
};
#endif

// acc[g0 + g] += sum_j scores[g0 + g, j] value_j for GROUPS queries at once, their
// GROUPS * CHUNKS sums in registers (one chain of adds per output, over the keys in order).
template <int CHUNKS, int GROUPS>
void weigh_values(const float* scores, int64_t g0, const HeadKV& kv, int64_t length, float* acc) {
  Vec::T sums[GROUPS][CHUNKS];
  for (int g = 0; g < GROUPS; ++g)
    for (int c = 0; c < CHUNKS; ++c) sums[g][c] = Vec::zero();
  for (int64_t j = 0; j < length; ++j) {
    const float* value = kv.value(j, CHUNKS * Vec::kLanes);
    for (int g = 0; g < GROUPS; ++g) {
      const Vec::T weight = Vec::broadcast(scores[(g0 + g) * length + j]);
      for (int c = 0; c < CHUNKS; ++c) sums[g][c] = Vec::fmadd(weight, Vec::load(value + Vec::kLanes * c), sums[g][c]);
    }
  }
  for (int g = 0; g < GROUPS; ++g)
    for (int c = 0; c < CHUNKS; ++c) Vec::store(acc + ((g0 + g) * CHUNKS + c) * Vec::kLanes, sums[g][c]);
}

// `weigh_values` for `groups` queries (1 to kSums / CHUNKS), GROUPS the first count tried
template <int CHUNKS, int GROUPS = 1>
void weigh_values_of(int64_t groups, const float* scores, int64_t g0, const HeadKV& kv, int64_t length, float* acc) {
  if constexpr (GROUPS * CHUNKS <= kSums || GROUPS == 1) {
    if (groups == GROUPS) return weigh_values<CHUNKS, GROUPS>(scores, g0, kv, length, acc);
    weigh_values_of<CHUNKS, GROUPS + 1>(groups, scores, g0, kv, length, acc);
  }
}

// `attend_loops` for a head of CHUNKS vectors: kLanes keys at a time, each query's kLanes dot
// products summed across their vectors together (`Vec::sum_each`); then the values weighed
// with up to kSums sums in registers, enough independent chains to keep both FMA units busy.
template <int CHUNKS>
void attend_vectors(const float* queries, int64_t group, const HeadKV& kv, int64_t length, float* scores, float* acc,
                    float* total) {
  constexpr int64_t lanes = Vec::kLanes, d = CHUNKS * lanes;
  for (int64_t j0 = 0; j0 < length; j0 += lanes) {
    const int64_t n = std::min<int64_t>(lanes, length - j0);
    for (int64_t g = 0; g < group; ++g) {
      const float* query = queries + g * d;
      Vec::T dots[lanes];
      for (int64_t jj = 0; jj < lanes; ++jj) {
        dots[jj] = Vec::zero();
        if (jj < n)
          for (int c = 0; c < CHUNKS; ++c)
            dots[jj] = Vec::fmadd(Vec::load(query + lanes * c), Vec::load(kv.key(j0 + jj, d) + lanes * c), dots[jj]);
      }
      Vec::store_first(scores + g * length + j0, Vec::sum_each(dots), n);
    }
  }
  softmax_numerators(scores, group, length, total);
  constexpr int64_t kAtOnce = std::max(1, kSums / CHUNKS);
  for (int64_t g0 = 0; g0 < group; g0 += kAtOnce)
    weigh_values_of<CHUNKS>(std::min(kAtOnce, group - g0), scores, g0, kv, length, acc);
}
#endif

void attend(const float* queries, int64_t group, const HeadKV& kv, int64_t length, int64_t d, float* scores, float* acc,
            float* total) {
#if defined(__AVX512F__) || defined(__AVX2__)
  switch (d) {
    case 16: return attend_vectors<16 / Vec::kLanes>(queries, group, kv, length, scores, acc, total);
    case 32: return attend_vectors<32 / Vec::kLanes>(queries, group, kv, length, scores, acc, total);
    case 64: return attend_vectors<64 / Vec::kLanes>(queries, group, kv, length, scores, acc, total);
    case 128: return attend_vectors<128 / Vec::kLanes>(queries, group, kv, length, scores, acc, total);
  }
#endif
  attend_loops(queries, group, kv, length, d, scores, acc, total);
}

// For each row b (one token at position p = positions[b], cache slot s = slots[b]):
//   k, q <- rotary(k), rotary(q);  K[s, :, p] <- k;  V[s, :, p] <- v
//   out[b, head] = softmax(q K[s, kv(head), :p+1]^T / sqrt(d)) V[s, kv(head), :p+1]
// with grouped-query heads sharing their KV head. Every row's key and value are written before
// any row attends, so rows may be one prompt's tokens (same slot, successive positions): a token
// then gets the same numbers in a prompt as in a decode step. One task per (row, KV head): it
// reads that head's keys and values once for all the query heads of its group.
// Optionally row b reads its first shared_lengths[b] keys and values from slot shared_slots[b]
// instead of its own: rows whose prompts start alike (a group's rollouts) hold copies of the
// same numbers, and reading one copy for all of them, one after another, reads the rest from
// the CPU's caches instead of memory.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                            at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& positions,
                            const std::optional<at::Tensor>& shared_slots,
                            const std::optional<at::Tensor>& shared_lengths) {
  check_float({&q, &k, &v, &cos, &sin, &k_cache, &v_cache}, "decode_attention");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [batch, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k, v need a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "the caches must be contiguous [slots, kv_heads, capacity, head_dim]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos and sin must be contiguous [batch, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong, "slots and positions are int64");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(1);
  const int64_t group = heads / kv_heads, n_slots = k_cache.size(0), capacity = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(1) == kv_heads && k_cache.size(3) == d, "head counts disagree");
  const auto slots_c = slots.contiguous(), positions_c = positions.contiguous();
  const int64_t* slot_of = slots_c.data_ptr<int64_t>();
  const int64_t* position_of = positions_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(slot_of[b] >= 0 && slot_of[b] < n_slots && position_of[b] >= 0 && position_of[b] < capacity,
                "row ", b, ": slot or position outside the cache");
  TORCH_CHECK(shared_slots.has_value() == shared_lengths.has_value(), "shared_slots and shared_lengths go together");
  at::Tensor lead_c = slots_c, split_c = at::zeros_like(slots_c);
  if (shared_slots.has_value()) {
    lead_c = shared_slots->contiguous(), split_c = shared_lengths->contiguous();
    TORCH_CHECK(lead_c.scalar_type() == at::kLong && split_c.scalar_type() == at::kLong && lead_c.numel() == batch &&
                split_c.numel() == batch, "shared_slots and shared_lengths are int64 [batch]");
  }
  const int64_t *lead_of = lead_c.data_ptr<int64_t>(), *split_of = split_c.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(lead_of[b] >= 0 && lead_of[b] < n_slots && split_of[b] >= 0 && split_of[b] <= position_of[b],
                "row ", b, ": its shared slot is outside the cache, or it shares past its own position");

  auto out = at::empty({batch, heads, d}, q.options());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *cos_p = cos.data_ptr<float>(), *sin_p = sin.data_ptr<float>();
  float *k_base = k_cache.data_ptr<float>(), *v_base = v_cache.data_ptr<float>(), *out_p = out.data_ptr<float>();

  at::parallel_for(0, batch * kv_heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, position = position_of[b];
      const int64_t head = (slot_of[b] * kv_heads + h) * capacity * d;
      rotate(kp + b * k.stride(0) + h * k.stride(1), cos_p + b * d, sin_p + b * d, k_base + head + position * d, d, 1.0f);
      const float* v_new = vp + b * v.stride(0) + h * v.stride(1);
      std::copy(v_new, v_new + d, v_base + head + position * d);
    }
  });
  // Each thread takes one run of tasks. A prompt's rows attend to ever more keys: rows are taken
  // first, last, second, second to last..., so that every run holds a fair share of work. Rows
  // that share keys are taken one after another, head by head.
  std::vector<int64_t> tasks(batch * kv_heads);
  if (shared_slots.has_value()) {
    std::vector<int64_t> rows(batch);
    for (int64_t b = 0; b < batch; ++b) rows[b] = b;
    std::stable_sort(rows.begin(), rows.end(), [&](int64_t x, int64_t y) { return lead_of[x] < lead_of[y]; });
    int64_t next = 0;
    for (int64_t first = 0; first < batch;) {
      int64_t last = first;
      while (last < batch && lead_of[rows[last]] == lead_of[rows[first]]) ++last;
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t r = first; r < last; ++r) tasks[next++] = rows[r] * kv_heads + h;
      first = last;
    }
  } else {
    for (int64_t task = 0; task < batch * kv_heads; ++task) {
      const int64_t turn = task / kv_heads, b = turn % 2 == 0 ? turn / 2 : batch - 1 - turn / 2;
      tasks[task] = b * kv_heads + task % kv_heads;
    }
  }
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * d), scores, acc(group * d), total(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = tasks[task] / kv_heads, h = tasks[task] % kv_heads;
      const int64_t position = position_of[b], length = position + 1;
      const float *cos_b = cos_p + b * d, *sin_b = sin_p + b * d;
      const int64_t own = (slot_of[b] * kv_heads + h) * capacity * d, lead = (lead_of[b] * kv_heads + h) * capacity * d;
      const HeadKV kv{k_base + lead, v_base + lead, k_base + own, v_base + own, split_of[b]};
      for (int64_t g = 0; g < group; ++g)
        rotate(qp + b * q.stride(0) + (h * group + g) * q.stride(1), cos_b, sin_b, queries.data() + g * d, d, scale);

      scores.resize(group * length);
      attend(queries.data(), group, kv, length, d, scores.data(), acc.data(), total.data());
      for (int64_t g = 0; g < group; ++g) {
        float* o = out_p + (b * heads + h * group + g) * d;
        const float inv = 1.f / total[g];
        for (int64_t i = 0; i < d; ++i) o[i] = acc[g * d + i] * inv;
      }
    }
  });
  return out;
}

}  // namespace
