// Fused float32 kernels for LeanLlama's CPU decode step (one new token per row).
//
// At decode batch sizes the step's matmuls stream their weights at the memory-bandwidth limit;
// what is left between them is ~20 small torch ops per layer, each a dispatch and a pass over
// memory. Three ops here replace them, a fourth draws the next tokens (a fifth, the draw alone),
// a sixth multiplies weights stored as exact integer groups, which cuts the bytes those matmuls
// stream, and a seventh adds a LoRA adapter's delta row by row. Built by cpu_kernels.py; each has
// an eager twin (llama.py, sampling.py, float64) that the tests compare it with.

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

void check_float(std::initializer_list<const at::Tensor*> tensors, const char* op) {
  for (const auto* t : tensors)
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), op, ": inputs must be float32 CPU tensors");
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


// Weights that are exactly small integers in groups, as the embedded model's (GGUF Q4_1 and
// Q8_0, see exact_groups.py): along each output's inputs, every 32 weights share a scale s and an
// offset m, and w = s * q + m with q an unsigned 4- or 8-bit code. 16 outputs form a tile: for
// each input, its 16 codes sit side by side in `codes` [tiles, in * bits / 8, 16] (in 4 bits,
// input 2p in the low nibbles and 2p + 1 in the high ones); `scales` and `offsets` are half
// floats [tiles, in / 32, 16], as GGUF stores them. Dequantizing is exact (s has 11 significant
// bits and q at most 8, so s * q is exact in float32 and + m rounds once, as the weight did), so
// this is x W^T + b with the float32 weights, reading 5 or 9 bits a weight instead of 32. Sums run
// over the inputs in order, ~1e-6 from a BLAS's blocked order.
// A tile's 16 outputs are kParts vectors of kLanes floats: one 512-bit register with AVX-512,
// two 256-bit ones with AVX2 (GCC splits a 64-byte vector on AVX2 through memory, ~5x slower).
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
constexpr int kParts = 16 / kLanes;
using f32xL = float __attribute__((vector_size(kLanes * sizeof(float))));
using u8xL = uint8_t __attribute__((vector_size(kLanes)));
using i32xL = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));
using u8x16 = uint8_t __attribute__((vector_size(16)));

// 16 codes -> kParts vectors of floats. GCC compiles the portable conversion of bytes read from
// memory to scalar code, so AVX-512 and AVX2 builds say it directly.
inline void to_float(u8x16 codes, f32xL* out) {
#ifdef __AVX512F__
  out[0] = reinterpret_cast<f32xL>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(reinterpret_cast<__m128i>(codes))));
#elif defined(__AVX2__)
  const __m128i bytes = reinterpret_cast<__m128i>(codes);
  out[0] = reinterpret_cast<f32xL>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
  out[1] = reinterpret_cast<f32xL>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))));
#else
  for (int p = 0; p < kParts; ++p) {
    u8xL part;
    std::memcpy(&part, reinterpret_cast<const uint8_t*>(&codes) + p * kLanes, sizeof part);
    out[p] = __builtin_convertvector(__builtin_convertvector(part, i32xL), f32xL);
  }
#endif
}

// 16 half floats -> kParts vectors of floats (F16C's conversion, in every AVX2 and AVX-512 CPU)
inline void halves_to_float(const uint16_t* halves, f32xL* out) {
#ifdef __AVX512F__
  out[0] = reinterpret_cast<f32xL>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves))));
#elif defined(__AVX2__)
  for (int p = 0; p < kParts; ++p)
    out[p] = reinterpret_cast<f32xL>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + 8 * p))));
#else
  for (int p = 0; p < kParts; ++p)
    for (int l = 0; l < kLanes; ++l) out[p][l] = static_cast<float>(c10::Half(halves[p * kLanes + l], c10::Half::from_bits()));
#endif
}

// acc[r] += x[r] * (s * q + m) for the ROWS rows of one input (xt: inputs transposed, [in, ROWS])
template <int ROWS>
inline void accumulate(f32xL (*acc)[kParts], const float* x, u8x16 codes, const f32xL* s, const f32xL* m) {
  f32xL w[kParts];
  to_float(codes, w);
  for (int p = 0; p < kParts; ++p) w[p] = w[p] * s[p] + m[p];
  for (int r = 0; r < ROWS; ++r)
    for (int p = 0; p < kParts; ++p) acc[r][p] += x[r] * w[p];
}

// From one tile to the next: its codes (bytes) and its scales or offsets (half floats)
inline int64_t tile_code_bytes(int64_t in, int64_t bits) { return in * bits * 2; }
inline int64_t tile_group_values(int64_t in) { return in / 32 * 16; }

// out[r, o0:o0+16*TILES] for ROWS rows and TILES adjacent tiles; a block's accumulators stay in
// registers. Each output is one chain of adds over the inputs in order, whatever ROWS and TILES
// are (a row's result does not depend on the rows or tiles beside it). A chain waits for its
// previous add, so a row alone keeps the CPU busy only with several tiles' chains side by side.
template <int ROWS, int BITS, int TILES>
inline void group_tile(const float* xt, const uint8_t* codes, const uint16_t* scales, const uint16_t* offsets,
                       int64_t in, float* out, int64_t out_stride) {
  const int64_t code_stride = tile_code_bytes(in, BITS), group_stride = tile_group_values(in);
  f32xL acc[TILES][ROWS][kParts];
  for (int t = 0; t < TILES; ++t)
    for (int r = 0; r < ROWS; ++r)
      for (int p = 0; p < kParts; ++p) acc[t][r][p] = f32xL{};
  for (int64_t g = 0; g < in / 32; ++g) {
    f32xL s[TILES][kParts], m[TILES][kParts];
    for (int t = 0; t < TILES; ++t) {
      halves_to_float(scales + t * group_stride + g * 16, s[t]);
      halves_to_float(offsets + t * group_stride + g * 16, m[t]);
    }
    for (int i = 0; i < 32; i += 8 / BITS) {  // one 16-byte load: 2 inputs in 4 bits, 1 in 8
      const float* x = xt + (g * 32 + i) * ROWS;
      for (int t = 0; t < TILES; ++t) {
        u8x16 bytes;
        std::memcpy(&bytes, codes + t * code_stride + (g * 32 + i) * BITS * 2, sizeof bytes);
        if constexpr (BITS == 4) {
          accumulate<ROWS>(acc[t], x, bytes & 15, s[t], m[t]);
          accumulate<ROWS>(acc[t], x + ROWS, bytes >> 4, s[t], m[t]);
        } else {
          accumulate<ROWS>(acc[t], x, bytes, s[t], m[t]);
        }
      }
    }
  }
  for (int t = 0; t < TILES; ++t)
    for (int r = 0; r < ROWS; ++r) std::memcpy(out + r * out_stride + t * 16, acc[t][r], sizeof acc[t][r]);
}

// A block's accumulators, ROWS x 16 floats, stay in vector registers: 16 rows of one register
// each in AVX-512's 32; with AVX2's 16, 8 rows of two each (the scales and offsets then come from
// memory; ~10% faster than 4-row blocks at 12-16 rows). Smaller blocks take several tiles at once,
// as many as leave room for their scales and offsets: one row's decode step 1.8x faster on
// AVX-512 (embedded model, 2 threads, side by side: 18.3 -> 10.2 ms).
#ifdef __AVX512F__
constexpr int64_t kBlockRows = 16;
constexpr int64_t kTileRun = 4;  // tiles a thread takes in one go
constexpr int tiles_at_once(int rows) { return rows <= 2 ? 4 : rows <= 8 ? 2 : 1; }
#else
constexpr int64_t kBlockRows = 8;
constexpr int64_t kTileRun = 2;
constexpr int tiles_at_once(int rows) { return rows <= 2 ? 2 : 1; }
#endif

// Tiles [t, tiles) of a run, AT_ONCE at a time while that many are left; returns the first not done.
template <int ROWS, int BITS, int AT_ONCE>
int tiles_by(int t, int tiles, const float* xt, const uint8_t* codes, const uint16_t* scales, const uint16_t* offsets,
             int64_t in, float* out, int64_t out_stride) {
  const int64_t code_stride = tile_code_bytes(in, BITS), group_stride = tile_group_values(in);
  for (; t + AT_ONCE <= tiles; t += AT_ONCE)
    group_tile<ROWS, BITS, AT_ONCE>(xt, codes + t * code_stride, scales + t * group_stride,
                                    offsets + t * group_stride, in, out + t * 16, out_stride);
  return t;
}

// `tiles` adjacent tiles (at most kTileRun) of a block of ROWS rows; a thread's last tiles, fewer
// than a run, go by halves
template <int ROWS, int BITS>
void tile_run(int tiles, const float* xt, const uint8_t* codes, const uint16_t* scales, const uint16_t* offsets,
              int64_t in, float* out, int64_t out_stride) {
  constexpr int at_once = tiles_at_once(ROWS);
  int t = tiles_by<ROWS, BITS, at_once>(0, tiles, xt, codes, scales, offsets, in, out, out_stride);
  if constexpr (at_once > 2) t = tiles_by<ROWS, BITS, 2>(t, tiles, xt, codes, scales, offsets, in, out, out_stride);
  if constexpr (at_once > 1) tiles_by<ROWS, BITS, 1>(t, tiles, xt, codes, scales, offsets, in, out, out_stride);
}

template <int BITS>
void group_rows(int size, int tiles, const float* xt, const uint8_t* codes, const uint16_t* scales,
                const uint16_t* offsets, int64_t in, float* out, int64_t out_stride) {
  switch (size) {
    case 16: return tile_run<16, BITS>(tiles, xt, codes, scales, offsets, in, out, out_stride);
    case 8: return tile_run<8, BITS>(tiles, xt, codes, scales, offsets, in, out, out_stride);
    case 4: return tile_run<4, BITS>(tiles, xt, codes, scales, offsets, in, out, out_stride);
    case 2: return tile_run<2, BITS>(tiles, xt, codes, scales, offsets, in, out, out_stride);
    default: return tile_run<1, BITS>(tiles, xt, codes, scales, offsets, in, out, out_stride);
  }
}

at::Tensor linear_groups(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& offsets, const std::optional<at::Tensor>& bias, int64_t bits) {
  check_float({&x}, "linear_groups");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && offsets.scalar_type() == at::kHalf,
              "linear_groups: scales and offsets must be float16");
  TORCH_CHECK(bits == 4 || bits == 8, "linear_groups: bits must be 4 or 8");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(2) == 16 && codes.is_contiguous(),
              "linear_groups: codes must be contiguous uint8 [tiles, in * bits / 8, 16]");
  const int64_t tiles = codes.size(0), in = codes.size(1) * 8 / bits, n = tiles * 16;
  TORCH_CHECK(in % 32 == 0 && x.size(-1) == in, "linear_groups: x's last dim must be the weight's ", in, " inputs");
  TORCH_CHECK(scales.is_contiguous() && offsets.is_contiguous() && scales.sizes() == offsets.sizes() &&
              scales.numel() == tiles * (in / 32) * 16, "linear_groups: scales and offsets must be [tiles, in / 32, 16]");
  const auto x_c = x.contiguous();
  const int64_t rows = x_c.numel() / in;
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, x.options());
  // rows in blocks of up to kBlockRows, then 8, 4, 2, 1, each block's inputs transposed so that a
  // row's input is a broadcast from the cache line the block's other rows share
  std::vector<std::pair<int64_t, int>> blocks;  // (first row, rows)
  for (int64_t r = 0; r < rows;) {
    const int64_t left = std::min<int64_t>(rows - r, kBlockRows);
    const int size = left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    blocks.emplace_back(r, size);
    r += size;
  }
  std::vector<float> xt(rows * in);
  const float* x_p = x_c.data_ptr<float>();
  for (const auto& [first, size] : blocks)
    for (int r = 0; r < size; ++r)
      for (int64_t i = 0; i < in; ++i) xt[first * in + i * size + r] = x_p[(first + r) * in + i];
  const uint8_t* codes_p = codes.data_ptr<uint8_t>();
  const auto *scales_p = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
             *offsets_p = reinterpret_cast<const uint16_t*>(offsets.data_ptr<at::Half>());
  float* out_p = out.data_ptr<float>();
  // a full block's accumulators take all the registers: then a tile at a time, each read from
  // L1 by every block in turn (a run of tiles per block was ~5% slower at 16 and 32 rows)
  const int64_t run_length = rows >= kBlockRows ? 1 : kTileRun;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t += run_length) {
      const int run = static_cast<int>(std::min(run_length, end - t));
      const uint8_t* tile_codes = codes_p + t * tile_code_bytes(in, bits);
      const uint16_t *tile_scales = scales_p + t * tile_group_values(in), *tile_offsets = offsets_p + t * tile_group_values(in);
      for (const auto& [first, size] : blocks) {
        const float* block_x = xt.data() + first * in;
        float* block_out = out_p + first * n + t * 16;
        (bits == 4 ? group_rows<4> : group_rows<8>)(size, run, block_x, tile_codes, tile_scales, tile_offsets, in,
                                                    block_out, n);
      }
    }
  });
  if (bias) out.add_(*bias);
  return out;
}

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
