"""16-bit weights with float32 products, for x86 CPUs without native bf16 (AVX2 + FMA + F16C; AVX-512).

Without bf16 dot-product instructions torch used to compute a bf16 checkpoint in float32, reading
4 bytes per weight every step; ATen's own bf16 and f16 kernels round the input to 16 bits and slow
down by the row (one matrix-vector product per row). This kernel keeps the weight in its 16 bits,
packed once (``pack``: 8 values of 4 rows per 64-byte line, so a block of rows streams as one
sequence), converts each 8 values to float32 in registers (a shift for bf16, F16C for f16) and
multiplies them with float32 rows of x: the weight is read once per call at half the bytes, and the
result differs from the float32 product of the same (exactly converted) weights only by the order of
the sums. Tiles of 4 weight rows x 3 input rows keep 12 accumulators in registers, so a few rows (a
verify pass) cost little more than one. Where AVX-512 runs, the same product is computed 16 lanes wide
(a 64-byte line as two registers, up to 8 input rows per pass), chosen at run time. Measurements:
docs/benchmarks.md, "16-bit weights with float32 products" and "EPYC-Zen5".

The same library carries ``specdec::linear16_dot`` for CPUs with avx512_bf16: bf16 weights on their own
packed layout (``pack_dot``) times bf16-rounded rows, with bf16 dot-product instructions into float32 sums
(linear.py's kind ``w16dot``; docs/benchmarks.md, "bf16 dot products").

It is a C++ extension (native.py: built once per machine, run on torch's threads) registered as the
operator ``specdec::linear16``, which the compiled step (compiled.py) calls as an extern kernel like
oneDNN's. ``available()`` says whether this CPU and this install can use it, and why not.
"""

from __future__ import annotations

import functools

import torch

from specdec.models import native

_SOURCE = r"""
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {

constexpr int64_t RB = 4;  // weight rows per block: the packed layout [blocks, K / 8, RB, 8]
// 64-byte lines ahead (16 KB): EPYC-Zen5, the shipped target's 33 products with weights from memory, float32
// products 16 lanes wide: 24 lines ahead 0.96 / 1.20 / 2.58 ms at 1 / 4 / 12 rows, 256 ahead 0.79 / 1.07 / 2.36
// (8 lanes: 1.00 / 1.81 / 3.93 against 0.86 / 1.60 / 3.48)
constexpr int64_t PREFETCH = 256;
constexpr int64_t SLAB = 48;  // input rows per pass over the weights

inline __m256 load8(const uint16_t* p, bool bf16) {  // 8 16-bit values -> float32, exactly
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <bool BF16, int C, bool TAIL>
__attribute__((always_inline)) inline void chunk(__m256 (&acc)[RB][C], const float* x, const uint16_t* w, int64_t K,
                                                 __m256i tail) {
  __m256 xv[C];
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) xv[c] = TAIL ? _mm256_maskload_ps(x + c * K, tail) : _mm256_loadu_ps(x + c * K);
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) {
    __m256 wv = load8(w + r * 8, BF16);  // the RB rows' 8 values: one 64-byte line
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
  }
}

// The chunks of one pass over a packed block, for the 8- and 16-lane code alike (CHUNK: chunk or chunk_w; a
// macro because each width's intrinsics must be inlined under its own target options): C input rows into
// acc, prefetching PF lines ahead; the one-row pass into two accumulator sets, a0 and a1, over alternate chunks.
#define SWEEP(CHUNK, C)                                                                                \
  for (int64_t kc = 0; kc < K / 8; ++kc) {                                                             \
    if (PF) _mm_prefetch(reinterpret_cast<const char*>(wb + (kc + PREFETCH) * RB * 8), _MM_HINT_T0);   \
    CHUNK<BF16, C, false>(acc, x + kc * 8, wb + kc * RB * 8, K, tail);                                 \
  }                                                                                                    \
  if (K % 8) CHUNK<BF16, C, true>(acc, x + K / 8 * 8, wb + K / 8 * RB * 8, K, tail);
#define SWEEP_ONE_ROW(CHUNK)                                                                           \
  int64_t kc = 0;                                                                                      \
  for (; kc + 2 <= K / 8; kc += 2) {                                                                   \
    _mm_prefetch(reinterpret_cast<const char*>(wb + (kc + PREFETCH) * RB * 8), _MM_HINT_T0);           \
    _mm_prefetch(reinterpret_cast<const char*>(wb + (kc + 1 + PREFETCH) * RB * 8), _MM_HINT_T0);       \
    CHUNK<BF16, 1, false>(a0, x + kc * 8, wb + kc * RB * 8, K, tail);                                  \
    CHUNK<BF16, 1, false>(a1, x + (kc + 1) * 8, wb + (kc + 1) * RB * 8, K, tail);                      \
  }                                                                                                    \
  if (kc < K / 8) CHUNK<BF16, 1, false>(a0, x + kc * 8, wb + kc * RB * 8, K, tail);                     \
  if (K % 8) CHUNK<BF16, 1, true>(a1, x + K / 8 * 8, wb + K / 8 * RB * 8, K, tail);

// each packed block of the product's weights, in parallel: fn(its packed weights, its outputs, its rows)
template <class Fn>
void for_blocks(const uint16_t* w, float* y, int64_t T, int64_t N, int64_t K, const Fn& fn) {
  const int64_t blocks = (N + RB - 1) / RB, KC = (K + 7) / 8;
  const int64_t grain = std::max<int64_t>(1, 16384 / (RB * K * std::max<int64_t>(T, 1)));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) fn(w + b * KC * RB * 8, y + b * RB, N - b * RB);
  });
}

// y[c * ldy + r] = sum_k x[c * K + k] * w(r, k) for r < min(RB, rows) of one packed block wb [KC, RB, 8]
// (zero past K) and c < C input rows; tail: the lanes of x's last, partial chunk. PF: prefetch lines ahead
// (into the next block), for products of several rows: without it their reads and sums ran one after the other
template <bool BF16, int C, bool PF>
inline void tile(const float* x, const uint16_t* wb, int64_t K, __m256i tail, float* y, int64_t ldy, int64_t rows) {
  __m256 acc[RB][C];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  SWEEP(chunk, C)
  for (int r = 0; r < RB && r < rows; ++r)
    for (int c = 0; c < C; ++c) y[c * ldy + r] = hsum(acc[r][c]);
}

// one input row (decoding): two sets of accumulators over alternate chunks, so consecutive FMAs on a
// row do not wait on each other's result, and lines prefetched ahead as for several rows (EPYC-AVX2,
// the shipped target's 33 products: 4.2-4.7 -> 3.4-3.8 ms; one set without prefetch was latency-bound)
template <bool BF16>
inline void tile1(const float* x, const uint16_t* wb, int64_t K, __m256i tail, float* y, int64_t rows) {
  __m256 a0[RB][1], a1[RB][1];
  for (int r = 0; r < RB; ++r) a0[r][0] = a1[r][0] = _mm256_setzero_ps();
  SWEEP_ONE_ROW(chunk)
  for (int r = 0; r < RB && r < rows; ++r) y[r] = hsum(_mm256_add_ps(a0[r][0], a1[r][0]));
}

template <bool BF16>
void product(const float* x, const uint16_t* w, float* y, int64_t T, int64_t N, int64_t K) {
  alignas(32) int32_t lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = i < K % 8 ? -1 : 0;
  const __m256i tail = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  for_blocks(w, y, T, N, K, [&](const uint16_t* wb, float* yb, int64_t rows) {
    if (T == 1) {  // decoding
      tile1<BF16>(x, wb, K, tail, yb, rows);
      return;
    }
    if (T >= 3) tile<BF16, 3, true>(x, wb, K, tail, yb, N, rows);
    else tile<BF16, 2, true>(x, wb, K, tail, yb, N, rows);
    int64_t c = T >= 3 ? 3 : 2;
    for (; c + 3 <= T; c += 3) tile<BF16, 3, false>(x + c * K, wb, K, tail, yb + c * N, N, rows);
    if (T - c == 2) tile<BF16, 2, false>(x + c * K, wb, K, tail, yb + c * N, N, rows);
    else if (T - c == 1) tile<BF16, 1, false>(x + c * K, wb, K, tail, yb + c * N, N, rows);
  });
}


// The same product 512 bits wide, for CPUs with AVX-512 (F, BW, DQ, VL): one 64-byte line of the packed
// layout (4 rows x 8 values) as two 16-lane registers (rows 0-1, rows 2-3), each input row's 8 values
// broadcast to both halves; up to WIDE_C input rows per pass over the weights. Chosen at run time
// (``wide_isa``), so the library built with the AVX2 flags runs on every AVX2 CPU.
constexpr int64_t WIDE_C = 8;  // 2 x 8 accumulators + 8 inputs + 2 weight registers of 32

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")

inline __m512 load16(const uint16_t* p, bool bf16) {  // 16 16-bit values (2 rows x 8) -> float32, exactly
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

template <bool BF16, int C, bool TAIL>
__attribute__((always_inline)) inline void chunk_w(__m512 (&acc)[2][C], const float* x, const uint16_t* w, int64_t K,
                                                   __mmask8 tail) {
  __m512 xv[C];
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c)
    xv[c] = _mm512_broadcast_f32x8(TAIL ? _mm256_maskz_loadu_ps(tail, x + c * K) : _mm256_loadu_ps(x + c * K));
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    __m512 wv = load16(w + h * 16, BF16);  // rows 2h, 2h + 1
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_fmadd_ps(wv, xv[c], acc[h][c]);
  }
}

inline float hsum_row(__m512 a, int r) {  // row r's 8 lanes of its row pair's register
  return hsum((r % 2) ? _mm512_extractf32x8_ps(a, 1) : _mm512_castps512_ps256(a));
}

template <bool BF16, int C, bool PF>
void tile_w(const float* x, const uint16_t* wb, int64_t K, __mmask8 tail, float* y, int64_t ldy, int64_t rows) {
  __m512 acc[2][C];
  for (int h = 0; h < 2; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
  SWEEP(chunk_w, C)
  for (int r = 0; r < RB && r < rows; ++r)
    for (int c = 0; c < C; ++c) y[c * ldy + r] = hsum_row(acc[r / 2][c], r);
}

template <bool BF16>
void tile1_w(const float* x, const uint16_t* wb, int64_t K, __mmask8 tail, float* y, int64_t rows) {
  __m512 a0[2][1], a1[2][1];  // two sets over alternate chunks, as tile1
  for (int h = 0; h < 2; ++h) a0[h][0] = a1[h][0] = _mm512_setzero_ps();
  SWEEP_ONE_ROW(chunk_w)
  for (int r = 0; r < RB && r < rows; ++r) y[r] = hsum_row(_mm512_add_ps(a0[r / 2][0], a1[r / 2][0]), r);
}

template <bool BF16, bool PF>
void tiles_w(int64_t C, const float* x, const uint16_t* wb, int64_t K, __mmask8 tail, float* y, int64_t ldy,
             int64_t rows) {  // C (1..WIDE_C) input rows in one pass
  switch (C) {
    case 1: tile_w<BF16, 1, PF>(x, wb, K, tail, y, ldy, rows); break;
    case 2: tile_w<BF16, 2, PF>(x, wb, K, tail, y, ldy, rows); break;
    case 3: tile_w<BF16, 3, PF>(x, wb, K, tail, y, ldy, rows); break;
    case 4: tile_w<BF16, 4, PF>(x, wb, K, tail, y, ldy, rows); break;
    case 5: tile_w<BF16, 5, PF>(x, wb, K, tail, y, ldy, rows); break;
    case 6: tile_w<BF16, 6, PF>(x, wb, K, tail, y, ldy, rows); break;
    case 7: tile_w<BF16, 7, PF>(x, wb, K, tail, y, ldy, rows); break;
    default: tile_w<BF16, 8, PF>(x, wb, K, tail, y, ldy, rows); break;
  }
}

template <bool BF16>
void product_w(const float* x, const uint16_t* w, float* y, int64_t T, int64_t N, int64_t K) {
  const __mmask8 tail = static_cast<__mmask8>((1u << (K % 8)) - 1);
  for_blocks(w, y, T, N, K, [&](const uint16_t* wb, float* yb, int64_t rows) {
    if (T == 1) {  // decoding
      tile1_w<BF16>(x, wb, K, tail, yb, rows);
      return;
    }
    tiles_w<BF16, true>(std::min(T, WIDE_C), x, wb, K, tail, yb, N, rows);
    for (int64_t c = WIDE_C; c < T; c += WIDE_C)
      tiles_w<BF16, false>(std::min(T - c, WIDE_C), x + c * K, wb, K, tail, yb + c * N, N, rows);
  });
}

#pragma GCC pop_options

// bf16 inputs with bf16 dot products (avx512_bf16), float32 sums, for CPUs with native bf16, on its own packed
// layout (pack_dot): [ceil(N / 16), ceil(K / 2), 16, 2], a 64-byte line holding one pair of inputs for 16 weight
// rows, so that one instruction multiplies a line by an input row's pair (broadcast from memory) into those 16
// rows' sums, with no horizontal sums. A pass multiplies NB blocks of 16 weight rows by C input rows.
constexpr int64_t DB = 16;  // weight rows per block of the dot layout
// 64-byte lines ahead in each block's stream (a pass reads 1-4 streams; EPYC-Zen5: 32-256 within the noise at 1
// row, 64 about the best for several)
constexpr int64_t DOT_PREFETCH = 64;
// A pass of 2-12 rows over a short unit (NB * KP lines up to this many: K up to ~1500 at NB 2) prefetches the next
// unit instead, the same lines one unit ahead: the hardware's streams do not ramp up within 16-88 KB, and the rows'
// products then wait on memory (EPYC-Zen5, the shipped target's verify of 10 tokens: products 13% faster, 2-6 tokens
// 4-8%; longer units, e.g. K = 2048, measured no gain).
constexpr int64_t DOT_UNIT_AHEAD = 1536;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")

inline __mmask16 rows_mask(int64_t rows) {  // the first min(rows, 16) lanes of a block's output
  return rows >= DB ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rows) - 1);
}

template <int NB, int C, bool PF>  // PF: prefetch the lines ``ahead`` of each block's stream
void tile_dot(const uint16_t* x, int64_t K, const uint16_t* w0, int64_t KP, float* y, int64_t ldy, int64_t rows,
              int64_t ahead) {
  __m512 acc[NB][C];
#pragma GCC unroll 16
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[j][c] = _mm512_setzero_ps();
  const int64_t full = K / 2;
  for (int64_t kp = 0; kp < full; ++kp) {
    __m512i wv[NB];
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) {
      if (PF) _mm_prefetch(reinterpret_cast<const char*>(w0 + (j * KP + kp + ahead) * 32), _MM_HINT_T0);
      wv[j] = _mm512_loadu_si512(w0 + (j * KP + kp) * 32);
    }
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      int32_t pair;
      std::memcpy(&pair, x + c * K + 2 * kp, 4);
      const __m512i xb = _mm512_set1_epi32(pair);
#pragma GCC unroll 16
      for (int j = 0; j < NB; ++j) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], (__m512bh)wv[j], (__m512bh)xb);
    }
  }
  if (K % 2) {  // the last input alone in its pair (its weights' partner is 0)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int32_t>(x[c * K + K - 1]));
#pragma GCC unroll 16
      for (int j = 0; j < NB; ++j)
        acc[j][c] = _mm512_dpbf16_ps(acc[j][c], (__m512bh)_mm512_loadu_si512(w0 + (j * KP + full) * 32), (__m512bh)xb);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __mmask16 m = rows_mask(rows - j * DB);
    for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(y + c * ldy + j * DB, m, acc[j][c]);
  }
}

// one input row against one block: four accumulators over alternate pairs (independent chains), one stream. Its
// sums run in another order than tile_dot's (one chain per row, the same for any NB and C, so 2 and more rows give
// each row the same result whatever their count): a row decoded alone differs from itself in a batch by float32
// rounding. One chain per row here too (tile_dot<4, 1>) made the shipped target's step 6-10% slower on EPYC-Zen5.
void tile1_dot(const uint16_t* x, int64_t K, const uint16_t* w0, float* y, int64_t rows) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const int64_t full = K / 2;
  int64_t kp = 0;
  for (; kp + 4 <= full; kp += 4) {
    _mm_prefetch(reinterpret_cast<const char*>(w0 + (kp + DOT_PREFETCH) * 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w0 + (kp + 2 + DOT_PREFETCH) * 32), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      int32_t pair;
      std::memcpy(&pair, x + 2 * (kp + u), 4);
      a[u] = _mm512_dpbf16_ps(a[u], (__m512bh)_mm512_loadu_si512(w0 + (kp + u) * 32), (__m512bh)_mm512_set1_epi32(pair));
    }
  }
  for (; kp < full; ++kp) {
    int32_t pair;
    std::memcpy(&pair, x + 2 * kp, 4);
    a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)_mm512_loadu_si512(w0 + kp * 32), (__m512bh)_mm512_set1_epi32(pair));
  }
  if (K % 2)
    a[1] = _mm512_dpbf16_ps(a[1], (__m512bh)_mm512_loadu_si512(w0 + full * 32),
                            (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[K - 1])));
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
  _mm512_mask_storeu_ps(y, rows_mask(rows), sum);
}

#define DOT_CASE(NB, C) case C: tile_dot<NB, C, PF>(x, K, w0, KP, y, ldy, rows, ahead); break;
template <int NB, bool PF>
void tiles_dot(int64_t C, const uint16_t* x, int64_t K, const uint16_t* w0, int64_t KP, float* y, int64_t ldy,
               int64_t rows, int64_t ahead) {  // C input rows in one pass: 1..12 for NB <= 2, 1..6 for NB 3-4
  if constexpr (NB <= 2) {
    switch (C) {
      DOT_CASE(NB, 1) DOT_CASE(NB, 2) DOT_CASE(NB, 3) DOT_CASE(NB, 4) DOT_CASE(NB, 5) DOT_CASE(NB, 6)
      DOT_CASE(NB, 7) DOT_CASE(NB, 8) DOT_CASE(NB, 9) DOT_CASE(NB, 10) DOT_CASE(NB, 11)
      default: tile_dot<NB, 12, PF>(x, K, w0, KP, y, ldy, rows, ahead);
    }
  } else {
    switch (C) {
      DOT_CASE(NB, 1) DOT_CASE(NB, 2) DOT_CASE(NB, 3) DOT_CASE(NB, 4) DOT_CASE(NB, 5)
      default: tile_dot<NB, 6, PF>(x, K, w0, KP, y, ldy, rows, ahead);
    }
  }
}
#undef DOT_CASE

template <int NB>  // the T input rows against NB blocks from w0 (fewer at the end), in passes of up to cmax rows
void unit_dot(int64_t nb, int64_t cmax, const uint16_t* x, int64_t T, int64_t K, const uint16_t* w0, int64_t KP,
              float* y, int64_t N, int64_t rows, int64_t ahead) {
  const int64_t passes = (T + cmax - 1) / cmax, C = (T + passes - 1) / passes;  // passes of equal rows
  for (int64_t c = 0; c < T; c += C) {
    const int64_t n = std::min(C, T - c);
    const bool first = c == 0;  // prefetch the next unit's lines on the first pass only
    switch (nb) {
      case 1: first ? tiles_dot<1, true>(n, x + c * K, K, w0, KP, y + c * N, N, rows, ahead)
                    : tiles_dot<1, false>(n, x + c * K, K, w0, KP, y + c * N, N, rows, ahead); break;
      case 2: first ? tiles_dot<2, true>(n, x + c * K, K, w0, KP, y + c * N, N, rows, ahead)
                    : tiles_dot<2, false>(n, x + c * K, K, w0, KP, y + c * N, N, rows, ahead); break;
      case 3: first ? tiles_dot<3, true>(n, x + c * K, K, w0, KP, y + c * N, N, rows, ahead)
                    : tiles_dot<3, false>(n, x + c * K, K, w0, KP, y + c * N, N, rows, ahead); break;
      default: first ? tiles_dot<4, true>(n, x + c * K, K, w0, KP, y + c * N, N, rows, ahead)
                     : tiles_dot<4, false>(n, x + c * K, K, w0, KP, y + c * N, N, rows, ahead); break;
    }
  }
}

// y [T, N] = x [T, K] @ w^T: one row block by block; more in units of NB blocks (16 NB weight rows) in parallel, each
// multiplied by all T rows in passes: 2-12 rows against 2 blocks in one pass (4 blocks for 2-6 rows measured 4-13%
// slower on EPYC-Zen5, weights streaming from memory, at the shipped target's shapes and at a 1B model's), more in
// passes of up to 6 against 4, the unit's weights staying in cache between them (the shipped target's products,
// hot: 2.20 ms at 33 rows, 28.9 at 512, against 5.11 and 45.6 with a 4-row layout, oneDNN 2.74 and 26.2)
bool amx_isa();

void product_d(const uint16_t* x, const uint16_t* w, float* y, int64_t T, int64_t N, int64_t K) {
  const int64_t KP = (K + 1) / 2, blocks = (N + DB - 1) / DB;
  // decoding: one stream per block, except on Xeons with AMX, where one row in units of 2 blocks with the next unit
  // prefetched (below) reads the weights faster: Xeon-AMX-FP16, 2 threads, a 1B model's products 73.5 against 92.9
  // ms, the shipped target's (in cache) 1.32 against 1.38
  if (T == 1 && !amx_isa()) {
    const int64_t grain = std::max<int64_t>(1, 16384 / (DB * K));
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) tile1_dot(x, K, w + b * KP * DB * 2, y + b * DB, N - b * DB);
    });
    return;
  }
  const int64_t NB = T <= 12 ? 2 : 4, cmax = NB == 2 ? 12 : 6;
  const int64_t units = (blocks + NB - 1) / NB;
  const int64_t ahead = (T <= 12 && NB * KP <= DOT_UNIT_AHEAD) ? NB * KP : DOT_PREFETCH;  // lines
  const int64_t grain = std::max<int64_t>(1, 16384 / (NB * DB * K * T));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u * NB, nb = std::min(NB, blocks - b);
      const uint16_t* w0 = w + b * KP * DB * 2;
      if (NB == 2) unit_dot<2>(nb, cmax, x, T, K, w0, KP, y + b * DB, N, N - b * DB, ahead);
      else unit_dot<4>(nb, cmax, x, T, K, w0, KP, y + b * DB, N, N - b * DB, ahead);
    }
  });
}

#pragma GCC pop_options

"""+ native.WIDE_ISA_CPP + r"""
// x [T, K] float32, w packed [ceil(N / RB), ceil(K / 8), RB, 8] bf16 or f16 -> [T, N] float32
at::Tensor linear16(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 4 && w.size(2) == RB && w.size(3) == 8,
              "specdec::linear16: x [rows, in] and a packed w [blocks, in / 8, 4, 8] expected, got ",
              x.sizes(), " and ", w.sizes());
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(w.size(0) == (N + RB - 1) / RB && w.size(1) == (K + 7) / 8,
              "specdec::linear16: the packed weight ", w.sizes(), " does not hold ", N, " x ", K);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "specdec::linear16: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf,
              "specdec::linear16: w must be bfloat16 or float16, got ", w.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "specdec::linear16: CPU tensors only");
  at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty({T, N}, xc.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  for (int64_t t0 = 0; t0 < T; t0 += SLAB) {  // rows in slabs, so a prefill's x stays in cache for each block
    const int64_t n = std::min(SLAB, T - t0);
    const float* xp = xc.data_ptr<float>() + t0 * K;
    float* yp = y.data_ptr<float>() + t0 * N;
    const bool bf16 = wc.scalar_type() == at::kBFloat16;
    if (wide_isa()) bf16 ? product_w<true>(xp, wp, yp, n, N, K) : product_w<false>(xp, wp, yp, n, N, K);
    else bf16 ? product<true>(xp, wp, yp, n, N, K) : product<false>(xp, wp, yp, n, N, K);
  }
  return y;
}

// bf16 dot products here (avx512_bf16, with the 16-lane code's AVX-512 subsets)
bool dot_isa() {
  static const bool dot = [] {
    __builtin_cpu_init();
    return wide_isa() && __builtin_cpu_supports("avx512bf16");
  }();
  return dot;
}

// AMX tiles on the same packed layout, for passes of many rows (a prefill, a large batch) on CPUs with amx_bf16: a
// block's 16 pairs of inputs (16 lines of 64 bytes, contiguous in pack_dot's layout) are one B tile as TDPBF16PS
// reads it, and 16 input rows of 32 inputs one A tile. Dot products read each weight line once per pass of up to 12
// rows, so a prefill of 512 rows reads the weights 40 times; a tile reads a line once for 16-32 rows and multiplies
// 16 x 16 x 32 in one instruction (Xeon-AMX-FP16, the shipped target's products for 512 rows: oneDNN 25 ms, dot
// products 136). Each output's sum is its own chain of pairs over K, as in the dot kernel, but the tile's internal order of a
// pair's two products is the hardware's: rows on tiles and rows on dot products differ by float32 rounding.
// Passes of fewer rows run on dot products. Xeon-AMX-FP16, 2 threads, the shipped target's products (weights in
// cache), dot / tiles:
// 1.23 / 1.57 ms at 1 row, 1.45 / 1.50 at 4, 1.64 / 1.50 at 5, 2.70 / 1.58 at 9; a 1B model's (from memory):
// 91 / 78 at 1 row, 74 / 78 at 4, 78 / 79 at 5, 101 / 77 at 9: tiles cost the same for 1 to 16 rows
constexpr int64_t AMX_MIN_ROWS = 5;
constexpr int64_t AMX_K = 32;  // inputs per A tile row (64 bytes of bf16)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_isa() {  // the CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use the tiles' state
  static const bool ok = [] {
    if (!dot_isa()) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")

// y [T, N] = x [T, K] (K a multiple of 32) @ w^T: units of 2 blocks (32 weight rows) in parallel, each against every
// 32 rows of x in turn, its B tiles reread from L1/L2. Tiles: 0-3 sums (rows 0-15 / 16-31 x blocks 0 / 1), 4-5 x,
// 6-7 w. The last T % 16 rows are read from ``tail`` (16 x K, zero rows after them); a tile of sums that holds rows
// past T or columns past N goes through a scratch tile, the rest straight to y (no padded copies of x or y: four tensor
// ops a product; Xeon-AMX-FP16, the shipped target's compiled 5-token verify 2-5% faster, v(4) 1.27-1.30 against
// 1.34-1.35 in alternating runs).
void product_amx(const uint16_t* x, const uint16_t* tail, const uint16_t* w, float* y, int64_t T, int64_t N,
                 int64_t K) {
  const int64_t KP = K / 2, blocks = (N + DB - 1) / DB, units = (blocks + 1) / 2;
  const int64_t full = T / 16, mtiles = (T + 15) / 16;
  const int64_t grain = std::max<int64_t>(1, 65536 / (2 * DB * K));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    // the thread's tile configuration is put back after: ggml's AMX kernels (llama.cpp) configure a thread's tiles
    // once and run on them after, so a thread left released (or configured our way) makes its next tile
    // instruction fault (SIGILL in ggml_backend_amx_mul_mat); LDTILECFG zeroes the tiles, whose data no caller keeps
    TileConfig saved, cfg;
    _tile_storeconfig(&saved);
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    alignas(64) float scratch[16 * 16];
    // where tile (m, b) of sums goes: straight into y, or (rows past T, columns past N) through scratch
    auto direct = [&](int64_t m, int64_t b) { return m < full && (b + 1) * DB <= N; };
    auto put = [&](int64_t m, int64_t b) {  // scratch -> y, the rows and columns that exist
      const int64_t rows = std::min<int64_t>(16, T - m * 16), cols = std::min<int64_t>(DB, N - b * DB);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(y + (m * 16 + r) * N + b * DB, scratch + r * 16, cols * 4);
    };
#define AMX_STORE(TILE, M, B)                                                   \
    if (direct(M, B)) _tile_stored(TILE, y + (M) * 16 * N + (B) * DB, N * 4);   \
    else { _tile_stored(TILE, scratch, 64); put(M, B); }
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = 2 * u;
      const bool two = b + 1 < blocks;
      const uint16_t* w0 = w + b * KP * DB * 2;
      const uint16_t* w1 = w0 + KP * DB * 2;
      for (int64_t m = 0; m < mtiles; m += 2) {
        const bool pair = m + 1 < mtiles;
        const uint16_t* x0 = m < full ? x + m * 16 * K : tail;
        const uint16_t* x1 = m + 1 < full ? x + (m + 1) * 16 * K : tail;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t k = 0; k < K; k += AMX_K) {
          _tile_loadd(4, x0 + k, K * 2);
          _tile_loadd(6, w0 + k * DB, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (two) { _tile_loadd(7, w1 + k * DB, 64); _tile_dpbf16ps(1, 4, 7); }
          if (pair) {
            _tile_loadd(5, x1 + k, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
          }
        }
        AMX_STORE(0, m, b)
        if (two) { AMX_STORE(1, m, b + 1) }
        if (pair) {
          AMX_STORE(2, m + 1, b)
          if (two) { AMX_STORE(3, m + 1, b + 1) }
        }
      }
    }
#undef AMX_STORE
    if (saved.palette != 0) _tile_loadconfig(&saved);
    else _tile_release();
  });
}

#pragma GCC pop_options

// x [T, K] bfloat16 (K a multiple of 32), w packed [ceil(N / 16), K / 2, 16, 2] -> [T, N] float32 on AMX tiles, the
// last T % 16 rows of x copied into a tile of 16 rows (zeros after them)
at::Tensor tiles_amx(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  const int64_t T = x.size(0), K = x.size(1), rest = T % 16;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<uint16_t> tail(rest ? 16 * K : 0, 0);
  if (rest) std::memcpy(tail.data(), xp + (T - rest) * K, rest * K * 2);
  at::Tensor y = at::empty({T, N}, x.options().dtype(at::kFloat));
  product_amx(xp, tail.data(), reinterpret_cast<const uint16_t*>(w.data_ptr()), y.data_ptr<float>(), T, N, K);
  return y;
}

// x [T, K] bfloat16, w packed by pack_dot [ceil(N / 16), ceil(K / 2), 16, 2] bf16 -> [T, N] float32; amx: on AMX tiles
// whatever T (tests, benchmarks; linear16_dot_amx)
at::Tensor dot_or_tiles(const at::Tensor& x, const at::Tensor& w, int64_t N, bool amx) {
  TORCH_CHECK(dot_isa(), "specdec::linear16_dot: this CPU has no avx512_bf16 (or ATEN_CPU_CAPABILITY holds ATen "
              "below AVX-512); use specdec::linear16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 4 && w.size(2) == DB && w.size(3) == 2,
              "specdec::linear16_dot: x [rows, in] and a packed w [blocks, in / 2, 16, 2] expected, got ",
              x.sizes(), " and ", w.sizes());
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(w.size(0) == (N + DB - 1) / DB && w.size(1) == (K + 1) / 2,
              "specdec::linear16_dot: the packed weight ", w.sizes(), " does not hold ", N, " x ", K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "specdec::linear16_dot: x and w must be bfloat16, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "specdec::linear16_dot: CPU tensors only");
  at::Tensor xc = x.contiguous(), wc = w.contiguous();
  if (amx || (T >= AMX_MIN_ROWS && K % AMX_K == 0 && amx_isa())) return tiles_amx(xc, wc, N);
  at::Tensor y = at::empty({T, N}, xc.options().dtype(at::kFloat));
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  for (int64_t t0 = 0; t0 < T; t0 += SLAB) {
    const int64_t n = std::min(SLAB, T - t0);
    product_d(xp + t0 * K, wp, y.data_ptr<float>() + t0 * N, n, N, K);
  }
  return y;
}

at::Tensor linear16_dot(const at::Tensor& x, const at::Tensor& w, int64_t N) { return dot_or_tiles(x, w, N, false); }

at::Tensor linear16_dot_amx(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  TORCH_CHECK(amx_isa(), "specdec::linear16_dot_amx: this CPU (or its kernel) offers no AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % AMX_K == 0, "specdec::linear16_dot_amx: x [rows, in] with in a multiple of ",
              AMX_K, " expected, got ", x.sizes());
  return dot_or_tiles(x, w, N, true);
}

}  // namespace

int64_t linear16_lanes() { return wide_isa() ? 16 : 8; }
bool linear16_dot_isa() { return dot_isa(); }
bool linear16_amx_isa() { return amx_isa(); }
int64_t linear16_amx_min_rows() { return AMX_MIN_ROWS; }

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("linear16(Tensor x, Tensor w, int out_features) -> Tensor");
  m.def("linear16_lanes() -> int", &linear16_lanes);
  m.def("linear16_dot(Tensor x, Tensor w, int out_features) -> Tensor");
  m.def("linear16_dot_isa() -> bool", &linear16_dot_isa);
  m.def("linear16_dot_amx(Tensor x, Tensor w, int out_features) -> Tensor");
  m.def("linear16_amx_isa() -> bool", &linear16_amx_isa);
  m.def("linear16_amx_min_rows() -> int", &linear16_amx_min_rows);
}
TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("linear16", &linear16);
  m.impl("linear16_dot", &linear16_dot);
  m.impl("linear16_dot_amx", &linear16_dot_amx);
}
"""


Availability = native.Availability
WHAT = "the 16-bit weight kernel"


@functools.cache
def available() -> Availability:
    """Whether this CPU and install run ``specdec::linear16`` (building it the first time), and why not."""
    return native.availability("linear16", _build, WHAT)


def _build() -> None:
    native.build("linear16", _SOURCE, WHAT)

    @torch.library.register_fake("specdec::linear16")
    def _(x, packed, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("specdec::linear16_dot")
    def _(x, packed, out_features):
        return x.new_empty(x.shape[0], out_features, dtype=torch.float32)

    @torch.library.register_fake("specdec::linear16_dot_amx")
    def _(x, packed, out_features):
        return x.new_empty(x.shape[0], out_features, dtype=torch.float32)


ROW_BLOCK = 4  # weight rows per packed block (the kernel's RB)
DOT_BLOCK = 16  # weight rows per block of the dot layout (the kernel's DB)


def _blocked(weight: torch.Tensor, rows: int, values: int) -> torch.Tensor:
    """weight [out, in] -> [ceil(out / rows), ceil(in / values), rows, values], zero-padded: a block of ``rows``
    rows as a sequence of lines of ``values`` inputs each."""
    n, k = weight.shape
    np_, kp = -(-n // rows) * rows, -(-k // values) * values
    padded = weight.new_zeros(np_, kp)
    padded[:n, :k] = weight
    return padded.view(np_ // rows, rows, kp // values, values).transpose(1, 2).contiguous()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bf16 or f16 -> [ceil(out / 4), ceil(in / 8), 4, 8], zero-padded: each 64-byte line
    holds 8 values of 4 rows, so a block of rows streams from memory as one sequence."""
    return _blocked(weight, ROW_BLOCK, 8)


def pack_dot(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bf16 -> [ceil(out / 16), ceil(in / 2), 16, 2], zero-padded, for ``linear16_dot``: each
    64-byte line holds one pair of inputs for 16 rows."""
    return _blocked(weight, DOT_BLOCK, 2)


def lanes() -> int:
    """The kernel's float32 lanes on this CPU (``available()`` first): 16 where AVX-512 F/BW/DQ/VL run (and
    ATEN_CPU_CAPABILITY does not hold ATen below AVX-512), else 8 (AVX2)."""
    return int(torch.ops.specdec.linear16_lanes())


def dot_products() -> bool:
    """Whether ``linear16_dot`` runs here (``available()`` first): avx512_bf16 with AVX-512 F/BW/DQ/VL, and ATen not
    held below AVX-512."""
    return bool(torch.ops.specdec.linear16_dot_isa())


def amx_tiles() -> bool:
    """Whether ``linear16_dot`` runs passes of many rows on AMX tiles here (``available()`` first): the CPU has
    AMX-TILE and AMX-BF16 and the OS lets the process use them."""
    return bool(torch.ops.specdec.linear16_amx_isa())


def amx_min_rows() -> int:
    """The row count from which ``linear16_dot`` runs a pass on AMX tiles where they run (the kernel's AMX_MIN_ROWS)."""
    return int(torch.ops.specdec.linear16_amx_min_rows())


def linear16_dot_amx(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``linear16_dot`` on AMX tiles whatever the row count (``amx_tiles()`` first; in a multiple of 32): what
    ``linear16_dot`` runs for 16 rows and more."""
    return torch.ops.specdec.linear16_dot_amx(x, packed, out_features)


def linear16_dot(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [rows, in] bfloat16, ``pack_dot(w)`` of a bf16 w [out, in] -> x @ w^T [rows, out] float32, from bf16 dot
    products (``dot_products()`` first)."""
    return torch.ops.specdec.linear16_dot(x, packed, out_features)


def linear16(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [rows, in] float32, ``pack(w)`` of w [out, in] -> x @ w^T [rows, out] float32 (``available()`` first)."""
    return torch.ops.specdec.linear16(x, packed, out_features)
