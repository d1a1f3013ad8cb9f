// linear_groups: x W^T + b with the weights stored as exact integer groups (GGUF Q4_1 and Q8_0),
// and the vector types it computes with (f32xL, kLanes wide), which lora.h uses too.

#pragma once

#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

namespace {

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

}  // namespace
