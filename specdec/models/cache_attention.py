"""Attention for a few queries that reads k and v where the KV cache holds them (x86, AVX2 + FMA).

The compiled step's attention (compiled.py) gathered each layer's attended keys and values out of the
whole cache (``cache[layer, rows, :, :L]``: a copy of L positions per layer and step) and ran two batched
matmuls and a softmax on the copy. ``specdec::cache_attention`` computes softmax(q k^T / sqrt(hd) + bias) v
straight from the cache row: the keys are read once, 8 at a time against each query (one horizontal-sum
tree per 8 dot products), the scores of a query stay in a buffer of L floats, and its output in 8
registers per 64 values. Query heads that share a KV head are done by the thread that reads it. Where
AVX-512 runs (chosen at run time) the same sums are 16 lanes wide and take that KV head's queries (its
grouped heads at each fed token) four at a time, reading each key and value once for all four
(EPYC-Zen5, 8 heads on 4, 320 keys: 10 queries a row 26-28 µs a layer, 9 queries 52 µs one at a time).
A query's keys stop at its last unmasked one. The result equals ``layers.few_query_attention`` on the
gathered keys up to the order of the sums (tests/test_cache_attention.py). A C++ extension (native.py); ``available()`` says whether it runs here.
"""

from __future__ import annotations

import functools

import torch

from specdec.models import native

_SOURCE = r"""
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {

inline __m256 sums8(const __m256 (&a)[8]) {  // 8 vectors -> the vector of their 8 sums
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// scores s[j] = q . k[j] * scale + bias[j], j < L; q [hd], k [L, hd] (hd a multiple of 8)
inline void scores(const float* q, const float* k, const float* bias, float scale, int64_t L, int64_t hd, float* s) {
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    __m256 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (j + u) * hd + d), a[u]);
    }
    _mm256_storeu_ps(s + j, _mm256_fmadd_ps(sums8(a), _mm256_set1_ps(scale), _mm256_loadu_ps(bias + j)));
  }
  for (; j < L; ++j) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + j * hd + d), a);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    s[j] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h))) * scale + bias[j];
  }
}

// s[j] <- exp(s[j] - max s) / sum: in place, L values; the max and the sum kept in vectors, reduced once
inline void softmax(float* s, int64_t L) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t W = Vec::size();
  auto add = [](Vec& x, Vec& y) { return x + y; };
  auto max = [](Vec& x, Vec& y) { return at::vec::maximum(x, y); };
  Vec mv(-INFINITY);
  int64_t j = 0;
  for (; j + W <= L; j += W) mv = at::vec::maximum(mv, Vec::loadu(s + j));
  float mx = at::vec::vec_reduce_all<float>(max, mv);
  for (; j < L; ++j) mx = std::max(mx, s[j]);
  Vec sv(0.f);
  for (j = 0; j + W <= L; j += W) {
    const Vec e = (Vec::loadu(s + j) - Vec(mx)).exp_u20();
    e.store(s + j);
    sv = sv + e;
  }
  float sum = at::vec::vec_reduce_all<float>(add, sv);
  for (; j < L; ++j) sum += (s[j] = std::exp(s[j] - mx));
  const float inv = 1.f / sum;
  for (j = 0; j + W <= L; j += W) (Vec::loadu(s + j) * Vec(inv)).store(s + j);
  for (; j < L; ++j) s[j] *= inv;
}

// out [hd] = sum_j p[j] v[j]; v [L, hd]: 64 outputs at a time in 8 registers
inline void values(const float* p, const float* v, int64_t L, int64_t hd, float* out) {
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    const int n = static_cast<int>(std::min<int64_t>(64, hd - d0) / 8);
    __m256 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
      if (p[j] == 0.f) continue;  // masked keys
      const __m256 pj = _mm256_set1_ps(p[j]);
      const float* vj = v + j * hd + d0;
      for (int u = 0; u < n; ++u) acc[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * u), acc[u]);
    }
    for (int u = 0; u < n; ++u) _mm256_storeu_ps(out + d0 + 8 * u, acc[u]);
  }
}

// The same attention 16 lanes wide (AVX-512 F/BW/DQ/VL, chosen at run time: wide_isa), for four (then two, one)
// queries of one KV head at a time (its grouped heads, the row's fed tokens): each key and value read once for all.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")

inline __m256 fold(__m512 a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }

inline __m128 sums4(const __m256 (&a)[4]) {  // 4 vectors -> their 4 sums
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// s_m[j] = q_m . k[j] * scale + bias_m[j] for the NQ queries m, j < L (hd a multiple of 16): KU keys a step,
// NQ x KU accumulators (8 keys for 1-2 queries, 4 for 4)
template <int NQ>
void scores_w(const float* const (&q)[NQ], const float* k, const float* const (&bias)[NQ], float scale, int64_t L,
              int64_t hd, float* const (&s)[NQ]) {
  constexpr int KU = NQ > 2 ? 4 : 8;
  int64_t j = 0;
  for (; j + KU <= L; j += KU) {
    __m512 a[NQ][KU];
    for (int m = 0; m < NQ; ++m)
      for (int u = 0; u < KU; ++u) a[m][u] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d += 16) {
      __m512 qv[NQ];
      for (int m = 0; m < NQ; ++m) qv[m] = _mm512_loadu_ps(q[m] + d);
      for (int u = 0; u < KU; ++u) {
        const __m512 kv = _mm512_loadu_ps(k + (j + u) * hd + d);
        for (int m = 0; m < NQ; ++m) a[m][u] = _mm512_fmadd_ps(qv[m], kv, a[m][u]);
      }
    }
    for (int m = 0; m < NQ; ++m) {
      __m256 f[KU];
      for (int u = 0; u < KU; ++u) f[u] = fold(a[m][u]);
      if constexpr (KU == 8)
        _mm256_storeu_ps(s[m] + j, _mm256_fmadd_ps(sums8(f), _mm256_set1_ps(scale), _mm256_loadu_ps(bias[m] + j)));
      else
        _mm_storeu_ps(s[m] + j, _mm_fmadd_ps(sums4(f), _mm_set1_ps(scale), _mm_loadu_ps(bias[m] + j)));
    }
  }
  for (; j < L; ++j)
    for (int m = 0; m < NQ; ++m) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t d = 0; d < hd; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q[m] + d), _mm512_loadu_ps(k + j * hd + d), a);
      s[m][j] = _mm512_reduce_add_ps(a) * scale + bias[m][j];
    }
}

// out_m [hd] = sum_j p_m[j] v[j] for the NQ queries m: 64 outputs at a time in 4 registers per query
template <int NQ>
void values_w(const float* const (&p)[NQ], const float* v, int64_t L, int64_t hd, float* const (&out)[NQ]) {
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    const int n = static_cast<int>(std::min<int64_t>(64, hd - d0) / 16);
    __m512 acc[NQ][4];
    for (int m = 0; m < NQ; ++m)
      for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
      bool seen = false;
      for (int m = 0; m < NQ; ++m) seen |= p[m][j] != 0.f;
      if (!seen) continue;  // masked keys
      const float* vj = v + j * hd + d0;
      for (int u = 0; u < n; ++u) {
        const __m512 vv = _mm512_loadu_ps(vj + 16 * u);
        for (int m = 0; m < NQ; ++m) acc[m][u] = _mm512_fmadd_ps(_mm512_set1_ps(p[m][j]), vv, acc[m][u]);
      }
    }
    for (int m = 0; m < NQ; ++m)
      for (int u = 0; u < n; ++u) _mm512_storeu_ps(out[m] + d0 + 16 * u, acc[m][u]);
  }
}

template <int NQ>
void attend_w(const float* const (&q)[NQ], const float* k, const float* v, const float* const (&bias)[NQ], float scale,
              int64_t L, int64_t hd, float* const (&s)[NQ], float* const (&out)[NQ]) {
  scores_w<NQ>(q, k, bias, scale, L, hd, s);
  for (int m = 0; m < NQ; ++m) softmax(s[m], L);
  values_w<NQ>(s, v, L, hd, out);
}

#pragma GCC pop_options

"""+ native.WIDE_ISA_CPP + r"""
// the keys a query attends over: up to its last one not masked (-inf) in its bias row (at least one), so that
// masked keys past it cost nothing (a causal prefill's half, the attended length's padding)
inline int64_t seen_keys(const float* bias, int64_t L) {
  int64_t n = L;
  while (n > 1 && bias[n - 1] == -INFINITY) --n;
  return n;
}

// the NQ queries m0 .. m0 + NQ - 1 of KV head g in batch row b (query m: token m / G, head g * G + m % G), 16 lanes
// wide, over the keys any of them sees; s: NQ score buffers of L floats
template <int NQ>
void attend_group(int64_t m0, int64_t b, int64_t g, int64_t T, int64_t H, int64_t G, int64_t hd, int64_t L,
                  const float* qp, const float* bp, float* op, const float* kp, const float* vp, float scale, float* s) {
  const float* qs[NQ];
  const float* bs[NQ];
  float* os[NQ];
  float* ss[NQ];
  int64_t Lq = 1;
  for (int u = 0; u < NQ; ++u) {
    const int64_t t = (m0 + u) / G, qi = ((b * T + t) * H + g * G + (m0 + u) % G) * hd;
    qs[u] = qp + qi;
    bs[u] = bp + (b * T + t) * L;
    os[u] = op + qi;
    ss[u] = s + u * L;
    Lq = std::max(Lq, seen_keys(bs[u], L));
  }
  attend_w<NQ>(qs, kp, vp, bs, scale, Lq, hd, ss, os);
}

// q [B, T, H, hd]; k, v [layers, rows, KVH, len, hd] float32; rows [B] (each batch row's cache row);
// bias [B, T, L] additive (0 seen, -inf not), L <= len -> [B, T, H, hd]
at::Tensor cache_attention(const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v, int64_t layer,
                           const at::Tensor& rows_, const at::Tensor& bias_) {
  TORCH_CHECK(q_.dim() == 4 && k.dim() == 5 && v.sizes() == k.sizes() && bias_.dim() == 3 && rows_.dim() == 1,
              "specdec::cache_attention: q [B, T, H, hd], k and v [layers, rows, KVH, len, hd], rows [B] and "
              "bias [B, T, L] expected, got ", q_.sizes(), ", ", k.sizes(), ", ", rows_.sizes(), ", ", bias_.sizes());
  TORCH_CHECK(q_.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              bias_.scalar_type() == at::kFloat, "specdec::cache_attention: float32 q, k, v and bias expected");
  TORCH_CHECK(q_.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "specdec::cache_attention: CPU tensors only");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "specdec::cache_attention: a contiguous cache expected");
  const at::Tensor q = q_.contiguous(), bias = bias_.contiguous(), rows = rows_.to(at::kLong).contiguous();
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3);
  const int64_t R = k.size(1), KVH = k.size(2), len = k.size(3), L = bias.size(2);
  TORCH_CHECK(k.size(4) == hd && hd % 8 == 0 && KVH > 0 && H % KVH == 0 && bias.size(0) == B && bias.size(1) == T &&
              rows.size(0) == B && L <= len && layer >= 0 && layer < k.size(0),
              "specdec::cache_attention: shapes do not agree: q ", q.sizes(), ", cache ", k.sizes(), ", bias ",
              bias.sizes(), ", layer ", layer, " (head_dim must be a multiple of 8)");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(rp[b] >= 0 && rp[b] < R, "specdec::cache_attention: cache row ", rp[b], " of ", R);
  at::Tensor out = at::empty({B, T, H, hd}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t G = H / KVH;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const bool wide = wide_isa() && hd % 16 == 0;
  at::parallel_for(0, B * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> s(4 * L);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / KVH, g = i % KVH;
      const int64_t at_row = ((layer * R + rp[b]) * KVH + g) * len * hd;  // [len, hd] of this KV head
      const float* kp = k.data_ptr<float>() + at_row;
      const float* vp = v.data_ptr<float>() + at_row;
      if (wide) {  // the KV head's T * G queries, four at a time, then two, then one
        const int64_t M = T * G;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) attend_group<4>(m, b, g, T, H, G, hd, L, qp, bp, op, kp, vp, scale, s.data());
        if (m + 2 <= M) {
          attend_group<2>(m, b, g, T, H, G, hd, L, qp, bp, op, kp, vp, scale, s.data());
          m += 2;
        }
        if (m < M) attend_group<1>(m, b, g, T, H, G, hd, L, qp, bp, op, kp, vp, scale, s.data());
        continue;
      }
      for (int64_t t = 0; t < T; ++t) {
        const float* bt = bp + (b * T + t) * L;
        const int64_t Lq = seen_keys(bt, L);
        for (int64_t h = g * G; h < (g + 1) * G; ++h) {
          const int64_t qi = ((b * T + t) * H + h) * hd;
          scores(qp + qi, kp, bt, scale, Lq, hd, s.data());
          softmax(s.data(), Lq);
          values(s.data(), vp, Lq, hd, op + qi);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("cache_attention(Tensor q, Tensor k_cache, Tensor v_cache, int layer, Tensor rows, Tensor bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("cache_attention", &cache_attention); }
"""

WHAT = "the cache attention kernel"


@functools.cache
def available() -> native.Availability:
    """Whether this CPU and install run ``specdec::cache_attention`` (building it the first time), and why not."""
    return native.availability("cache_attention", _build, WHAT)


def _build() -> None:
    native.build("cache_attention", _SOURCE, WHAT)

    @torch.library.register_fake("specdec::cache_attention")
    def _(q, k_cache, v_cache, layer, rows, bias):
        return q.new_empty(q.shape)


def supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether the kernel runs attention in ``dtype`` (the queries' and the cache's) on ``device``."""
    return dtype == torch.float32 and device.type == "cpu" and head_dim % 8 == 0 and available().ok


def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int, rows: torch.Tensor,
                    bias: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, hd] float32 over ``k_cache[layer, rows[b], :, :L]`` and v's, bias [B, T, L] additive
    -> [B, T, H, hd] (``available()`` first)."""
    return torch.ops.specdec.cache_attention(q, k_cache, v_cache, layer, rows, bias)
