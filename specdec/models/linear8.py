"""8- and 4-bit weights with 8-bit inputs and integer sums, for products whose weights are read more than used:
an EAGLE-3 head's one-row passes.

A head's step multiplies one row by 8.5M weights (17 MB in bf16), and on a CPU whose caches cannot hold
them beside the target's, every step reads them from memory and pushes the target's out. These kernels
keep the weights in int8 (a float32 scale per output row) or int4 (a float16 scale per row and group of 64
inputs), quantize each input row to int8 on the fly (symmetric, its own scale) and sum the products in
int32 with ``vpdpbusd``: a half or a quarter of the bytes of bf16. The results approximate the bf16
product (a drafter's: the verifier reads the drafter's q as the drafter made it, so exactness holds
whatever the drafts). Measurements: docs/benchmarks.md, "2026-12-06, evening".

int8 (``pack``): [ceil(out / 16), ceil(in / 4), 16, 4] int8, each 64-byte line 4 inputs of 16 rows, the
lanes of one ``vpdpbusd``; the inputs are shifted to unsigned as VNNI reads them, and ``comp`` = 128 x the
row's sum takes the shift back out. A row's result is ``float(sum - comp) * input scale * row scale``, in
this order, so ``reference`` reproduces it bit for bit.

int4 (``pack4``): [ceil(out / 16), in / 8, 16, 4] uint8, each 64-byte line two such lines of nibbles (w + 8:
the unsigned operand; the signed inputs the other), a group's sums less 8 x its inputs' sum, times the
group's scales, summed in float32, then times the input scale (``reference4``: the same up to float32
rounding of that sum).

Both run where AVX512-VNNI (16 rows a line) or AVX-VNNI (two halves of 8) does; ``isa()`` says which. On
a CPU with AVX2 alone int4 runs on ``vpmaddubsw`` (the unsigned nibbles times the signed inputs cannot
saturate its 16-bit pair sums) and int8 does not (``available(8)`` says why); where specdec's kernels cannot
build at all the head keeps its 16-bit products. A C++ extension (native.py)
registered as ``specdec::linear8`` and ``specdec::linear4``, which the compiled head calls as extern kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from specdec.models import native

_SOURCE = r"""
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {

constexpr int64_t RB = 16;       // weight rows per block; a 64-byte line holds 4 inputs of each
constexpr int64_t PREFETCH = 64;  // lines ahead (4 KB)
constexpr int64_t CMAX = 4;       // input rows per pass over a block

// one input row r [K] -> its int8 values round(r / s) + shift into o [KP] (shift past K) and s = max |r| / 127
template <class Q>
void quantize_row(const float* r, int64_t K, int64_t KP, int32_t shift, Q* o, float* s) {
  float m = 0.f;
  for (int64_t k = 0; k < K; ++k) m = std::max(m, std::fabs(r[k]));
  const float inv = m > 0.f ? 127.0f / m : 0.f;
  *s = m / 127.0f;
  for (int64_t k = 0; k < K; ++k) o[k] = static_cast<Q>(static_cast<int32_t>(std::nearbyint(r[k] * inv)) + shift);
  for (int64_t k = K; k < KP; ++k) o[k] = static_cast<Q>(shift);
}

// x [T, K] float32 -> q [T, K4] uint8 (round(x / s) + 128, 128 past K) and s [T] = max |x| / 127
void quantize(const float* x, int64_t T, int64_t K, int64_t K4, uint8_t* q, float* s) {
  for (int64_t t = 0; t < T; ++t) quantize_row(x + t * K, K, K4, 128, q + t * K4, s + t);
}

// x [T, K] float32 -> q [T, KP] int8 (round(x / s), 0 past K), s [T] = max |x| / 127 and, per group of G inputs,
// comp [T, KP / G] = 8 x the group's sum of q (what the weights' unsigned nibbles, w + 8, add to each group's sum)
void quantize4(const float* x, int64_t T, int64_t K, int64_t KP, int64_t G, int8_t* q, float* s, int32_t* comp) {
  for (int64_t t = 0; t < T; ++t) {
    int8_t* o = q + t * KP;
    quantize_row(x + t * K, K, KP, 0, o, s + t);
    for (int64_t g = 0; g < KP / G; ++g) {
      int32_t sum = 0;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += o[k];
      comp[t * (KP / G) + g] = 8 * sum;
    }
  }
}

inline int32_t four(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")

// C input rows against one block wb [KQ, 16, 4]: U chains of sums per row over alternate lines (independent
// dependency chains: one row's sums would otherwise wait on each other), then y = float(sum - comp) * s * scale
template <int C>
void block512(const uint8_t* q, int64_t K4, const int8_t* wb, int64_t KQ, const float* s, const int32_t* comp,
              const float* scale, float* y, int64_t ldy, int64_t rows) {
  constexpr int U = C >= 4 ? 1 : 4 / C;
  __m512i acc[C][U];
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) acc[c][u] = _mm512_setzero_si512();
  int64_t kq = 0;
  for (; kq + U <= KQ; kq += U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      _mm_prefetch(reinterpret_cast<const char*>(wb + (kq + u + PREFETCH) * 64), _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(wb + (kq + u) * 64);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c)
        acc[c][u] = _mm512_dpbusd_epi32(acc[c][u], _mm512_set1_epi32(four(q + c * K4 + (kq + u) * 4)), wv);
    }
  }
  for (; kq < KQ; ++kq) {
    const __m512i wv = _mm512_loadu_si512(wb + kq * 64);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c)
      acc[c][0] = _mm512_dpbusd_epi32(acc[c][0], _mm512_set1_epi32(four(q + c * K4 + kq * 4)), wv);
  }
  const __mmask16 m = rows >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rows) - 1);
  const __m512i cv = _mm512_loadu_si512(comp);  // comp and scale are padded to whole blocks
  const __m512 sv = _mm512_loadu_ps(scale);
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) {
    __m512i sum = acc[c][0];
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) sum = _mm512_add_epi32(sum, acc[c][u]);
    const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, cv));
    _mm512_mask_storeu_ps(y + c * ldy, m, _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(s[c])), sv));
  }
}

// int4: C input rows (int8, q4) against one block wb [KP / 8, 16, 4] of nibble pairs (a line's low nibbles are inputs
// 8j..8j+3 of its 16 rows, its high nibbles 8j+4..8j+7, each w + 8), groups of G inputs with an f16 scale per row
// (sc [groups, 16]): per group the integer sums of (w + 8) x less comp, times the scales, summed in float32 (FMA),
// then times the input row's scale. Two chains a row (four for one row) over the low and high nibbles.
template <int C>
void block4_512(const int8_t* q, int64_t KP, const uint8_t* wb, int64_t G, const float* s, const int32_t* comp,
                const uint16_t* sc, float* y, int64_t ldy, int64_t rows) {
  constexpr int U = C == 1 ? 2 : 1;  // line pairs in flight per row
  const int64_t groups = KP / G, lines = G / 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 f[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) f[c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[C][2 * U];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
      for (int u = 0; u < 2 * U; ++u) acc[c][u] = _mm512_setzero_si512();
    const uint8_t* wg = wb + g * lines * 64;
    // line l of the group into chain pair u: its low nibbles times inputs 8l..8l+3, its high ones times 8l+4..8l+7
    auto line = [&](int64_t l, int u) __attribute__((always_inline)) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + (l + PREFETCH) * 64), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(wg + l * 64);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const uint8_t* xq = reinterpret_cast<const uint8_t*>(q + c * KP + g * G + l * 8);
        acc[c][2 * u] = _mm512_dpbusd_epi32(acc[c][2 * u], lo, _mm512_set1_epi32(four(xq)));
        acc[c][2 * u + 1] = _mm512_dpbusd_epi32(acc[c][2 * u + 1], hi, _mm512_set1_epi32(four(xq + 4)));
      }
    };
    int64_t l = 0;
    for (; l + U <= lines; l += U)
#pragma GCC unroll 2
      for (int u = 0; u < U; ++u) line(l + u, u);
    for (; l < lines; ++l) line(l, 0);
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * 16)));
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      __m512i sum = acc[c][0];
#pragma GCC unroll 4
      for (int u = 1; u < 2 * U; ++u) sum = _mm512_add_epi32(sum, acc[c][u]);
      sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(comp[c * groups + g]));
      f[c] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum), f[c]);
    }
  }
  const __mmask16 m = rows >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rows) - 1);
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(y + c * ldy, m, _mm512_mul_ps(f[c], _mm512_set1_ps(s[c])));
}

#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")

// the same with 8 lanes: a line's first 32 bytes are rows 0-7, its last 32 rows 8-15
template <int C>
void block256(const uint8_t* q, int64_t K4, const int8_t* wb, int64_t KQ, const float* s, const int32_t* comp,
              const float* scale, float* y, int64_t ldy, int64_t rows) {
  constexpr int U = C >= 2 ? 1 : 2;
  __m256i acc[C][2][U];
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c)
    for (int h = 0; h < 2; ++h)
#pragma GCC unroll 2
      for (int u = 0; u < U; ++u) acc[c][h][u] = _mm256_setzero_si256();
  int64_t kq = 0;
  for (; kq + U <= KQ; kq += U) {
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u) {
      _mm_prefetch(reinterpret_cast<const char*>(wb + (kq + u + PREFETCH) * 64), _MM_HINT_T0);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + (kq + u) * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + (kq + u) * 64 + 32));
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        const __m256i xb = _mm256_set1_epi32(four(q + c * K4 + (kq + u) * 4));
        acc[c][0][u] = _mm256_dpbusd_avx_epi32(acc[c][0][u], xb, w0);
        acc[c][1][u] = _mm256_dpbusd_avx_epi32(acc[c][1][u], xb, w1);
      }
    }
  }
  for (; kq < KQ; ++kq) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + kq * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + kq * 64 + 32));
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m256i xb = _mm256_set1_epi32(four(q + c * K4 + kq * 4));
      acc[c][0][0] = _mm256_dpbusd_avx_epi32(acc[c][0][0], xb, w0);
      acc[c][1][0] = _mm256_dpbusd_avx_epi32(acc[c][1][0], xb, w1);
    }
  }
  for (int c = 0; c < C; ++c) {
    alignas(32) float out[16];
    for (int h = 0; h < 2; ++h) {
      __m256i sum = acc[c][h][0];
      for (int u = 1; u < U; ++u) sum = _mm256_add_epi32(sum, acc[c][h][u]);
      const __m256i cv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(comp + 8 * h));
      const __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(sum, cv));
      _mm256_store_ps(out + 8 * h, _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(s[c])), _mm256_loadu_ps(scale + 8 * h)));
    }
    std::memcpy(y + c * ldy, out, sizeof(float) * std::min<int64_t>(rows, 16));
  }
}

// block4_512 with 8 lanes: a line's first 32 bytes are rows 0-7, its last 32 rows 8-15. VNNI false: for a CPU with
// AVX2 alone (built under this region's options, it uses none of VNNI's instructions): vpmaddubsw multiplies the
// unsigned nibbles (0..15) by the signed inputs into 16-bit pair sums (at most 2 x 15 x 127, so a line's low and high
// halves add without saturating) and vpmaddwd widens them: the same integer sums in three instructions, not one
template <int C, bool VNNI>
void block4_256(const int8_t* q, int64_t KP, const uint8_t* wb, int64_t G, const float* s, const int32_t* comp,
                const uint16_t* sc, float* y, int64_t ldy, int64_t rows) {
  const int64_t groups = KP / G, lines = G / 8;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 f[C][2];
  for (int c = 0; c < C; ++c) f[c][0] = f[c][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[C][2][2];  // [row][half][low / high nibbles] (AVX2 alone: both in the first)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h) acc[c][h][0] = acc[c][h][1] = _mm256_setzero_si256();
    const uint8_t* wg = wb + g * lines * 64;
    for (int64_t l = 0; l < lines; ++l) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + (l + PREFETCH) * 64), _MM_HINT_T0);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + l * 64 + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          const uint8_t* xq = reinterpret_cast<const uint8_t*>(q + c * KP + g * G + l * 8);
          const __m256i xlo = _mm256_set1_epi32(four(xq)), xhi = _mm256_set1_epi32(four(xq + 4));
          if constexpr (VNNI) {
            acc[c][h][0] = _mm256_dpbusd_avx_epi32(acc[c][h][0], lo, xlo);
            acc[c][h][1] = _mm256_dpbusd_avx_epi32(acc[c][h][1], hi, xhi);
          } else {
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
            acc[c][h][0] = _mm256_add_epi32(acc[c][h][0], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * 16 + 8 * h)));
      for (int c = 0; c < C; ++c) {
        const __m256i sum = _mm256_sub_epi32(_mm256_add_epi32(acc[c][h][0], acc[c][h][1]),
                                             _mm256_set1_epi32(comp[c * groups + g]));
        f[c][h] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sum), f[c][h]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    alignas(32) float out[16];
    for (int h = 0; h < 2; ++h) _mm256_store_ps(out + 8 * h, _mm256_mul_ps(f[c][h], _mm256_set1_ps(s[c])));
    std::memcpy(y + c * ldy, out, sizeof(float) * std::min<int64_t>(rows, 16));
  }
}

#pragma GCC pop_options

"""+ native.WIDE_ISA_CPP + r"""
// 2: AVX512-VNNI (with AVX-512 F/BW/DQ/VL, ATen not held below AVX-512), 1: AVX-VNNI, 0: neither (or
// SPECDEC_NO_VNNI set: what a CPU with AVX2 alone runs)
int64_t isa() {
  static const int64_t v = [] {
    __builtin_cpu_init();
    const char* off = std::getenv("SPECDEC_NO_VNNI");
    if (off != nullptr && off[0] != '\0' && std::string(off) != "0") return 0;
    if (wide_isa() && __builtin_cpu_supports("avx512vnni")) return 2;
    if (__builtin_cpu_supports("avxvnni")) return 1;
    return 0;
  }();
  return v;
}

template <int C>
void block(const uint8_t* q, int64_t K4, const int8_t* wb, int64_t KQ, const float* s, const int32_t* comp,
           const float* scale, float* y, int64_t ldy, int64_t rows) {
  if (isa() == 2) block512<C>(q, K4, wb, KQ, s, comp, scale, y, ldy, rows);
  else block256<C>(q, K4, wb, KQ, s, comp, scale, y, ldy, rows);
}

template <int C>
void block4(const int8_t* q, int64_t KP, const uint8_t* wb, int64_t G, const float* s, const int32_t* comp,
            const uint16_t* sc, float* y, int64_t ldy, int64_t rows) {
  if (isa() == 2) block4_512<C>(q, KP, wb, G, s, comp, sc, y, ldy, rows);
  else if (isa() == 1) block4_256<C, true>(q, KP, wb, G, s, comp, sc, y, ldy, rows);
  else block4_256<C, false>(q, KP, wb, G, s, comp, sc, y, ldy, rows);
}

// each block of the packed weights (block_bytes each), in parallel, times the T input rows in passes of up to CMAX:
// fn(C, block, first row) with C a std::integral_constant, the pass's rows
template <class Fn>
void for_passes(int64_t T, int64_t blocks, int64_t block_bytes, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, 32768 / (block_bytes * std::max<int64_t>(T, 1)));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < T; c += CMAX) switch (std::min(CMAX, T - c)) {
          case 1: fn(std::integral_constant<int, 1>{}, b, c); break;
          case 2: fn(std::integral_constant<int, 2>{}, b, c); break;
          case 3: fn(std::integral_constant<int, 3>{}, b, c); break;
          default: fn(std::integral_constant<int, 4>{}, b, c);
        }
  });
}

// x [T, K] float32, w [ceil(N / 16), KP / 8, 16, 4] uint8 nibble pairs (KP: K padded to a multiple of G), scale
// [blocks, KP / G, 16] float16 -> [T, N] float32
at::Tensor linear4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t N, int64_t G) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 4 && w.size(2) == RB && w.size(3) == 4 && scale.dim() == 3,
              "specdec::linear4: x [rows, in], a packed w [blocks, in / 8, 16, 4] and scales [blocks, in / G, 16] "
              "expected, got ", x.sizes(), ", ", w.sizes(), " and ", scale.sizes());
  TORCH_CHECK(G >= 8 && G % 8 == 0, "specdec::linear4: the group size must be a multiple of 8, got ", G);
  const int64_t T = x.size(0), K = x.size(1), blocks = w.size(0), KP = w.size(1) * 8;
  TORCH_CHECK(blocks == (N + RB - 1) / RB && KP % G == 0 && KP >= K && KP - K < G && scale.size(0) == blocks &&
                  scale.size(1) == KP / G && scale.size(2) == RB,
              "specdec::linear4: the packed weight ", w.sizes(), " and scales ", scale.sizes(), " do not hold ", N,
              " x ", K, " in groups of ", G);
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte && scale.scalar_type() == at::kHalf,
              "specdec::linear4: x float32, w uint8 and scale float16 expected");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "specdec::linear4: CPU tensors only");
  at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = scale.contiguous();
  at::Tensor y = at::empty({T, N}, xc.options());
  const int64_t groups = KP / G;
  std::vector<int8_t> q(T * KP);
  std::vector<float> s(T);
  std::vector<int32_t> comp(T * groups);
  quantize4(xc.data_ptr<float>(), T, K, KP, G, q.data(), s.data(), comp.data());
  const auto* wp = reinterpret_cast<const uint8_t*>(wc.data_ptr());
  const auto* sp = reinterpret_cast<const uint16_t*>(sc.data_ptr());
  float* yp = y.data_ptr<float>();
  for_passes(T, blocks, RB * KP / 2, [&](auto C, int64_t b, int64_t c) {
    block4<decltype(C)::value>(q.data() + c * KP, KP, wp + b * KP * RB / 2, G, s.data() + c, comp.data() + c * groups,
                               sp + b * groups * RB, yp + c * N + b * RB, N, N - b * RB);
  });
  return y;
}

// x [T, K] float32, w [ceil(N / 16), ceil(K / 4), 16, 4] int8, scale [blocks * 16] float32, comp [blocks * 16]
// int32 -> [T, N] float32
at::Tensor linear8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& comp,
                   int64_t N) {
  TORCH_CHECK(isa() > 0, "specdec::linear8: this CPU has neither AVX512-VNNI nor AVX-VNNI");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 4 && w.size(2) == RB && w.size(3) == 4,
              "specdec::linear8: x [rows, in] and a packed w [blocks, in / 4, 16, 4] expected, got ", x.sizes(),
              " and ", w.sizes());
  const int64_t T = x.size(0), K = x.size(1), blocks = w.size(0), KQ = w.size(1), K4 = KQ * 4;
  TORCH_CHECK(blocks == (N + RB - 1) / RB && KQ == (K + 3) / 4, "specdec::linear8: the packed weight ", w.sizes(),
              " does not hold ", N, " x ", K);
  TORCH_CHECK(scale.numel() == blocks * RB && comp.numel() == blocks * RB,
              "specdec::linear8: scale and comp must hold ", blocks * RB, " values each");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat &&
                  comp.scalar_type() == at::kInt,
              "specdec::linear8: x float32, w int8, scale float32 and comp int32 expected");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "specdec::linear8: CPU tensors only");
  at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = scale.contiguous(), cc = comp.contiguous();
  at::Tensor y = at::empty({T, N}, xc.options());
  std::vector<uint8_t> q(T * K4);
  std::vector<float> s(T);
  quantize(xc.data_ptr<float>(), T, K, K4, q.data(), s.data());
  const auto* wp = reinterpret_cast<const int8_t*>(wc.data_ptr());
  const float* sp = sc.data_ptr<float>();
  const int32_t* cp = cc.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  for_passes(T, blocks, RB * K4, [&](auto C, int64_t b, int64_t c) {
    block<decltype(C)::value>(q.data() + c * K4, K4, wp + b * KQ * RB * 4, KQ, s.data() + c, cp + b * RB, sp + b * RB,
                              yp + c * N + b * RB, N, N - b * RB);
  });
  return y;
}

}  // namespace

int64_t linear8_isa() { return isa(); }

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("linear8(Tensor x, Tensor w, Tensor scale, Tensor comp, int out_features) -> Tensor");
  m.def("linear8_isa() -> int", &linear8_isa);
  m.def("linear4(Tensor x, Tensor w, Tensor scale, int out_features, int group) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("linear8", &linear8);
  m.impl("linear4", &linear4);
}
"""

WHAT = "the 8-bit weight kernel"
ROW_BLOCK = 16  # weight rows per packed block (the kernel's RB)


NO_VNNI_ENV = "SPECDEC_NO_VNNI"  # set: the kernels run as on a CPU with AVX2 alone (int4 only), for tests


@functools.cache
def available(bits: int = 8) -> native.Availability:
    """Whether this CPU and install run the ``bits``-bit kernel (building it the first time), and why not: int4
    wherever specdec's kernels build (AVX2, FMA, F16C), int8 where AVX512-VNNI or AVX-VNNI runs too."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    built = native.availability("linear8", _build, WHAT)
    if built.ok and bits == 8 and isa() == 0:
        return native.Availability(False, "the CPU has neither AVX512-VNNI nor AVX-VNNI (int8 dot products); "
                                          "int4 runs on AVX2")
    return built


def _build() -> None:
    native.build("linear8", _SOURCE, WHAT)

    @torch.library.register_fake("specdec::linear8")
    def _(x, w, scale, comp, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("specdec::linear4")
    def _(x, w, scale, out_features, group):
        return x.new_empty(x.shape[0], out_features)


def isa() -> int:
    """2 where the kernels run 16 lanes wide (AVX512-VNNI), 1 where 8 (AVX-VNNI), 0 where neither runs (int4 on
    AVX2 alone, no int8; ``available()`` first)."""
    return int(torch.ops.specdec.linear8_isa())


@dataclass(frozen=True)
class Packed8:
    weight: torch.Tensor  # [ceil(out / 16), ceil(in / 4), 16, 4] int8
    scale: torch.Tensor  # [blocks * 16] float32: max |row| / 127 (0 past out)
    comp: torch.Tensor  # [blocks * 16] int32: 128 x the row's sum of int8 values


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> its int8 values [out, in] and per-row scales [out] float32 (symmetric: a row's
    largest magnitude is 127; an all-zero row has scale 0): how ``pack`` stores a weight row and the kernels
    quantize an input row."""
    w = weight.detach().float()
    m = w.abs().amax(dim=1)  # [out]
    inv = torch.where(m > 0, torch.tensor(127.0) / m, torch.zeros_like(m))
    return torch.round(w * inv[:, None]).to(torch.int8), m / 127.0


def pack(weight: torch.Tensor) -> Packed8:
    """weight [out, in] (any float dtype) -> ``Packed8``: its rows in int8, blocked for the kernel."""
    n, k = weight.shape
    q, scale = quantize_rows(weight)
    blocks, kq = -(-n // ROW_BLOCK), -(-k // 4)
    padded = torch.zeros(blocks * ROW_BLOCK, kq * 4, dtype=torch.int8)
    padded[:n, :k] = q
    blocked = padded.view(blocks, ROW_BLOCK, kq, 4).transpose(1, 2).contiguous()
    scale_p = torch.zeros(blocks * ROW_BLOCK)
    scale_p[:n] = scale
    comp = 128 * padded.to(torch.int32).sum(dim=1, dtype=torch.int32)
    return Packed8(blocked, scale_p, comp.to(torch.int32))


def linear8(x: torch.Tensor, packed: Packed8, out_features: int) -> torch.Tensor:
    """x [rows, in] float32 -> approximately x @ w^T [rows, out] float32 (``available()`` first)."""
    return torch.ops.specdec.linear8(x, packed.weight, packed.scale, packed.comp, out_features)


def reference(x: torch.Tensor, packed: Packed8, out_features: int) -> torch.Tensor:
    """What ``linear8`` computes, in torch, bit for bit: the inputs quantized as the kernel quantizes them, the
    sums in integers, then float(sum - comp) * input scale * row scale."""
    rows, k = x.shape
    blocks, kq = packed.weight.shape[:2]
    w = packed.weight.transpose(1, 2).reshape(blocks * ROW_BLOCK, kq * 4)[:out_features].to(torch.int64)
    xq, xs = quantize_rows(x)  # the kernel quantizes each input row as pack does a weight row
    q = torch.full((rows, kq * 4), 128, dtype=torch.int64)
    q[:, :k] = xq.to(torch.int64) + 128
    sums = (q @ w.T - packed.comp[:out_features].to(torch.int64)).to(torch.int32)  # [rows, out]
    return sums.float() * xs[:, None] * packed.scale[:out_features][None]


GROUP = 64  # inputs per int4 scale


@dataclass(frozen=True)
class Packed4:
    weight: torch.Tensor  # [ceil(out / 16), KP / 8, 16, 4] uint8: nibble pairs of w + 8 (KP: in padded to the group)
    scale: torch.Tensor  # [blocks, KP / group, 16] float16: max |group| / 7 (0 past out)
    group: int


def pack4(weight: torch.Tensor, group: int = GROUP) -> Packed4:
    """weight [out, in] (any float dtype) -> ``Packed4``: each group of ``group`` inputs of a row in int4 (-8..7,
    symmetric: its largest magnitude is 7) with a float16 scale, blocked for the kernel."""
    if group < 8 or group % 8:
        raise ValueError(f"the int4 group size must be a multiple of 8, got {group}")
    n, k = weight.shape
    blocks, kp = -(-n // ROW_BLOCK), -(-k // group) * group
    w = torch.zeros(blocks * ROW_BLOCK, kp)
    w[:n, :k] = weight.detach().float()
    g = w.view(blocks * ROW_BLOCK, kp // group, group)
    scale = (g.abs().amax(dim=2) / 7).half()  # [rows, groups]
    s = scale.float()
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = (torch.round(g * inv[..., None]).clamp(-8, 7) + 8).to(torch.uint8).view(blocks * ROW_BLOCK, kp)
    quads = q.view(blocks, ROW_BLOCK, kp // 8, 2, 4)  # [blocks, 16, lines, low / high, 4]
    nibbles = (quads[:, :, :, 0] | (quads[:, :, :, 1] << 4)).transpose(1, 2).contiguous()  # [blocks, lines, 16, 4]
    return Packed4(nibbles, scale.view(blocks, ROW_BLOCK, kp // group).transpose(1, 2).contiguous(), group)


def linear4(x: torch.Tensor, packed: Packed4, out_features: int) -> torch.Tensor:
    """x [rows, in] float32 -> approximately x @ w^T [rows, out] float32 (``available()`` first)."""
    return torch.ops.specdec.linear4(x, packed.weight, packed.scale, out_features, packed.group)


def unpack4(packed: Packed4, out_features: int, in_features: int) -> torch.Tensor:
    """The int4 values [out, in] (-8..7) that ``pack4`` stored."""
    blocks, lines = packed.weight.shape[:2]
    v = packed.weight.transpose(1, 2)  # [blocks, 16, lines, 4]
    quads = torch.stack([v & 0x0F, v >> 4], dim=3)  # [blocks, 16, lines, 2, 4]
    return (quads.reshape(blocks * ROW_BLOCK, lines * 8).to(torch.int64) - 8)[:out_features, :in_features]


def reference4(x: torch.Tensor, packed: Packed4, out_features: int) -> torch.Tensor:
    """What ``linear4`` computes, in torch: the inputs quantized as the kernel quantizes them, each group's sum in
    integers times its scale, summed over groups (in float64 here, float32 FMAs in the kernel), times the input
    scale."""
    rows, k = x.shape
    w = unpack4(packed, out_features, k)  # [out, in]
    G = packed.group
    xq, xs = quantize_rows(x)  # [rows, in] int8, [rows]
    q = xq.to(torch.int64)
    groups = -(-k // G)
    wp = torch.zeros(out_features, groups * G, dtype=torch.int64)
    wp[:, :k] = w
    qp = torch.zeros(rows, groups * G, dtype=torch.int64)
    qp[:, :k] = q
    sums = torch.einsum("rgi,ogi->rog", qp.view(rows, groups, G), wp.view(out_features, groups, G))  # [rows, out, g]
    scale = packed.scale.transpose(1, 2).reshape(-1, groups)[:out_features].double()  # [out, groups]
    return ((sums.double() * scale[None]).sum(dim=2) * xs.double()[:, None]).float()
