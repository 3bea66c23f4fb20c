"""A sampled row's probabilities in one native pass on the CPU: temperature, the top-k and top-p cut, the
softmax and min-p (``sampling.probs_from_logits``); a drafter's q and draw in one call (``sample_rows``:
``sampling.sample_from_logits``); the verifier's rule for one row in one call (``verify_row``:
``verify.verify_row``). Functions of a pybind11 module, called without torch's dispatcher: right after a
forward a dispatched op costs ~36 µs in cache misses, a pybind11 call ~6-10 (Xeon-AMX-FP16).

The same rule as ``sampling._top_k_top_p_sorted`` without sorting the row: each token falls in a bucket of
its weight w = exp(z - max z) (an eighth of a binade below 1 a bucket, read off w's bits); counts and masses
per bucket find the bucket that holds each cut, and only that bucket's tokens are ranked, by value and at a
tie by id (as ``sampling._top_k_top_p_numpy`` keeps ties). Only the tokens near the top are bucketed: rings of
whole buckets below the maximum are gathered (vectorized integer compares) until they hold the cut, and for
top-p alone only the last ring is bucketed (a real draft row at T 0.8, top_p 0.95 keeps ~600 of 8,192 tokens,
down to ~7.5 nats). The scaled logits are made in the output row itself, then their weights in place. Masses
are summed in float64, the exponentials are ATen's vectorized ``exp`` (within 1 ulp). A mass within 1e-6 (relative) of top_p counts as reaching it, so
where the mass above a token is top_p itself up to float32's rounding this may keep one token less than the
sort rule's float32 sums (tests/test_sampling.py leaves such rows out). A C++ extension (models/native.py);
``available()`` says whether it runs here.
"""

from __future__ import annotations

import functools

import torch

from specdec.models import native

_SOURCE = r"""
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <functional>
#include <immintrin.h>
#include <mutex>
#include <vector>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/DistributionsHelper.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

namespace {

// t as a contiguous float32 (int64 when ``integer``) tensor: itself when it is one, without a dispatched call
// (each costs µs in cache misses right after a forward)
at::Tensor as_dense(const at::Tensor& t, bool integer = false) {
  const auto want = integer ? at::kLong : at::kFloat;
  return t.scalar_type() == want && t.is_contiguous() ? t : t.to(want).contiguous();
}

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

// z = x / t (as torch divides), returns max z
float scaled(const float* x, int64_t V, float t, float* z) {
  Vec mv(-INFINITY);
  int64_t j = 0;
  for (; j + W <= V; j += W) {
    const Vec v = Vec::loadu(x + j) / Vec(t);
    v.store(z + j);
    mv = at::vec::maximum(mv, v);
  }
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, mv);
  for (; j < V; ++j) m = std::max(m, z[j] = x[j] / t);
  return m;
}

// w = exp(z - m) (w may be z itself)
void weights(const float* z, int64_t V, float m, float* w) {
  int64_t j = 0;
  for (; j + W <= V; j += W) (Vec::loadu(z + j) - Vec(m)).exp().store(w + j);
  for (; j < V; ++j) w[j] = std::exp(z[j] - m);
}

// One row's cut in buckets of the weights w = exp(z - max z), each w in (0, 1]: bucket b holds the tokens whose w
// lies b eighths of a binade below 1 (the bits of w read as an integer, as ``key_of`` says; the last bucket also
// every lower one and 0), so that every token of a bucket ranks below every token of the ones before it (exp keeps
// z's order, up to w's own rounding); a cut is found bucket by bucket from the top, then inside its bucket by the scaled
// logit z and, at a tie, by id. The tokens are gathered in rings from the top (down to RINGS[j] buckets, whole
// buckets) until the rings hold the cut (top-k: k tokens; top-p: the mass it needs); tokens below them are cut,
// and for top-p alone the rings above the last are kept whole, so only the last ring is bucketed. Every test is
// an integer compare of w's bits. A row's scratch is kept per thread (no allocation a call).
constexpr int BUCKETS = 512;
constexpr int BUCKET_SHIFT = 20;  // 2^(23 - 20) = 8 buckets a binade (~0.087 nat each)
constexpr int32_t ONE_BITS = 0x3F800000;  // the bits of 1.0f
constexpr double TIE = 1e-6;  // relative
constexpr int RINGS[] = {48, 72, 96, 120, 144, 192, 384};  // ring ends in buckets (~4.2 .. 33 nats); then every token

inline int32_t bits_of(float w) {
  int32_t u;
  std::memcpy(&u, &w, sizeof u);
  return u;
}

// w's bucket: how many eighths of a binade below 1 (0 for w = 1; BUCKETS - 1 for w below 2^-64 or 0)
inline int key_of(float w) {
  const int32_t below = std::max<int32_t>(ONE_BITS - bits_of(w), 0);
  return std::min<int32_t>(below >> BUCKET_SHIFT, BUCKETS - 1);
}

// a float64 sum of float32 vectors, 8 at a time (two lanes of four doubles)
struct Sum64 {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  void add(__m256 v) {
    a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  }
  double total() const {
    alignas(32) double t[4];
    _mm256_store_pd(t, _mm256_add_pd(a0, a1));
    return (t[0] + t[1]) + (t[2] + t[3]);
  }
};

struct Row {
  const float* x = nullptr;  // [V] the logits (z = x / t, recomputed where a bucket is ranked)
  float t = 1.f;  // the row's temperature
  float* w = nullptr;  // [V] the weights exp(z - max z), cut in place
  int64_t V = 0;
  std::vector<int32_t> cand;  // [V] the gathered tokens' ids: ring by ring from the top, each ring's ascending
  size_t cands = 0;  // how many
  size_t ring_at = 0;  // where the last ring starts in cand
  int first = 0, limit = 0;  // the last ring's buckets: first .. limit - 1 (limit BUCKETS: down to every token)
  double ring_mass = 0.0, inner_mass = 0.0;  // the last ring's weight; the rings' before it
  size_t filled_at = 0;  // the tokens ``fill`` bucketed: cand[filled_at:]
  std::vector<uint16_t> key;  // [V] each bucketed token's bucket, at its place in cand
  std::vector<int32_t> count = std::vector<int32_t>(BUCKETS);  // bucketed tokens a bucket
  std::vector<double> mass = std::vector<double>(BUCKETS);  // their weight a bucket
  std::vector<std::pair<float, int32_t>> ranked;  // one bucket's (z, id), ranked (``rank``)
  std::vector<double> kept;  // ... their weights

  void reset(const float* x_, float t_, float* w_, int64_t v) {
    x = x_, t = t_, w = w_, V = v;
    if (static_cast<int64_t>(cand.size()) < v) cand.resize(v), key.resize(v);
    cands = ring_at = filled_at = 0;
    first = limit = 0;
    ring_mass = inner_mass = 0.0;
  }

  // the next ring: from the last ring's end down to bucket ``end`` (exclusive; BUCKETS: every token left)
  void next_ring(int end) {
    inner_mass += ring_mass;
    ring_mass = 0.0;
    ring_at = cands;
    first = limit;
    limit = end;
    const float* ws = w;
    const int64_t n = V;
    size_t size = cands;
    int32_t* out = cand.data();
    // a token is in the ring where first << SHIFT <= ONE_BITS - bits(w) < limit << SHIFT, i.e. where
    // bits(w) in (ONE_BITS - (limit << SHIFT), ONE_BITS - (first << SHIFT)] (every bucket whole, as key_of says)
    const bool to_end = limit >= BUCKETS;
    const __m256i above = _mm256_set1_epi32(ONE_BITS - (first << BUCKET_SHIFT) + 1);  // bits < this
    const __m256i below = _mm256_set1_epi32(to_end ? INT32_MIN : ONE_BITS - (limit << BUCKET_SHIFT));  // bits > this
    Sum64 sum;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(ws + i);
      const __m256i u = _mm256_castps_si256(v);
      __m256i in = _mm256_cmpgt_epi32(above, u);
      if (!to_end) in = _mm256_and_si256(in, _mm256_cmpgt_epi32(u, below));
      int bits = _mm256_movemask_ps(_mm256_castsi256_ps(in));
      if (!bits) continue;
      sum.add(_mm256_and_ps(v, _mm256_castsi256_ps(in)));
      for (; bits; bits &= bits - 1) out[size++] = static_cast<int32_t>(i + __builtin_ctz(bits));
    }
    ring_mass = sum.total();
    for (; i < n; ++i) {
      const int k = key_of(ws[i]);
      if (k >= first && (to_end || k < limit)) out[size++] = static_cast<int32_t>(i), ring_mass += ws[i];
    }
    cands = size;
  }

  void fill(size_t at) {  // bucket cand[at:]
    std::fill(count.begin(), count.end(), 0);
    std::fill(mass.begin(), mass.end(), 0.0);
    filled_at = at;
    for (size_t c = at; c < cands; ++c) {
      const float wc = w[cand[c]];
      const int b = key_of(wc);
      key[c] = static_cast<uint16_t>(b);
      count[b] += 1;
      mass[b] += wc;
    }
  }

  void rank(int b) {  // ranked, kept <- bucket b's tokens by z (descending), then id; their weights
    ranked.clear();
    for (size_t c = filled_at; c < cands; ++c)
      if (key[c] == b) ranked.emplace_back(x[cand[c]] / t, cand[c]);  // z as scaled() makes it
    std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& c) { return a.first > c.first; });
    kept.resize(ranked.size());
    for (size_t j = 0; j < ranked.size(); ++j) kept[j] = w[ranked[j].second];
  }

  void keep(int b, int64_t n) {  // keep the buckets before b and the first n ranked tokens of bucket b
    if (limit < BUCKETS) {  // every token past the rings is cut
      const __m256i below = _mm256_set1_epi32(ONE_BITS - (limit << BUCKET_SHIFT));
      int64_t i = 0;
      for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(w + i);
        const __m256i in = _mm256_cmpgt_epi32(_mm256_castps_si256(v), below);
        _mm256_storeu_ps(w + i, _mm256_and_ps(v, _mm256_castsi256_ps(in)));
      }
      for (; i < V; ++i)
        if (key_of(w[i]) >= limit) w[i] = 0.f;
    }
    for (size_t c = filled_at; c < cands; ++c)
      if (key[c] >= b) w[cand[c]] = 0.f;
    for (int64_t j = 0; j < n; ++j) w[ranked[j].second] = static_cast<float>(kept[j]);
  }
};

// the weight of w [V], summed in float64
double total_of(const float* w, int64_t V) {
  Sum64 sum;
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) sum.add(_mm256_loadu_ps(w + j));
  double total = sum.total();
  for (; j < V; ++j) total += w[j];
  return total;
}

// top-k (k < V) then top-p (p < 1) over r.w: the sort rule's cut (sampling._top_k_top_p_sorted)
void cut(Row& r, int64_t k, float p) {
  const bool by_k = k > 0 && k < r.V;
  const double total = by_k ? 0.0 : total_of(r.w, r.V);  // top-p alone: of every token
  // a mass within TIE of p's counts as reaching it: float32 weights carry rounding of that order, and masses
  // that are p itself in decimals (0.5 + 0.3 for top_p 0.8) reach it, as the sort rule's float32 sums say
  const double p_target = static_cast<double>(p) * total * (1.0 - TIE);
  for (const int end : RINGS) {  // rings until they hold k tokens, or (top-p alone) the target's mass
    r.next_ring(end);
    if (by_k ? static_cast<int64_t>(r.cands) >= k : r.inner_mass + r.ring_mass >= p_target) break;
  }
  if (by_k ? static_cast<int64_t>(r.cands) < k : r.inner_mass + r.ring_mass < p_target) r.next_ring(BUCKETS);
  // top-k: every gathered token bucketed; top-p alone: the last ring's (the rings above it are kept whole)
  r.fill(by_k ? 0 : r.ring_at);
  int b = BUCKETS;  // the bucket holding the cut (BUCKETS: none, every token a candidate)
  int64_t n = 0;  // tokens kept in it
  double above = 0.0;  // mass of the buckets before b
  if (by_k) {
    int64_t seen = 0;
    for (b = 0; seen + r.count[b] < k; ++b) {
      seen += r.count[b];
      above += r.mass[b];
    }
    r.rank(b);
    n = k - seen;
  }
  if (p < 1.f) {
    double target = p_target;
    if (by_k) {
      double sum = above;
      for (int64_t j = 0; j < n; ++j) sum += r.kept[j];
      target = static_cast<double>(p) * sum * (1.0 - TIE);
    }
    int bp = by_k ? 0 : r.first;
    double acc = by_k ? 0.0 : r.inner_mass;  // keep a token while the mass strictly above it is below the target
    const int last = by_k ? BUCKETS - 1 : std::min(r.limit, BUCKETS) - 1;  // the walk stays in the bucketed ring
    while (bp < b && bp < last && acc + r.mass[bp] < target) acc += r.mass[bp++];
    if (bp < b) {  // the cut moves up to bucket bp
      r.rank(bp);
      n = static_cast<int64_t>(r.ranked.size());
      b = bp;
    }
    int64_t j = 0;
    while (j < n && acc < target) acc += r.kept[j++];
    n = std::max<int64_t>(j, 1);
  }
  r.keep(b, n);
}

// the rows' sampling parameters [S]: temperature, top_p and min_p float32, top_k int64
struct Params {
  at::Tensor t, k, p, m;
  Params(const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p)
      : t(as_dense(temperature)), k(as_dense(top_k, true)), p(as_dense(top_p)), m(as_dense(min_p)) {
    TORCH_CHECK(k.numel() == t.numel() && p.numel() == t.numel() && m.numel() == t.numel(),
                "sampling parameters: one of each a row");
  }
  int64_t rows() const { return t.numel(); }
};

// w [V] *= 1 / sum(w)
void normalise(float* w, int64_t V) {
  Vec s0(0.f), s1(0.f);
  int64_t j = 0;
  for (; j + 2 * W <= V; j += 2 * W) {
    s0 = s0 + Vec::loadu(w + j);
    s1 = s1 + Vec::loadu(w + j + W);
  }
  Vec sv = s0 + s1;
  double sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sv);
  for (; j < V; ++j) sum += w[j];
  const float inv = static_cast<float>(1.0 / sum);
  for (j = 0; j + W <= V; j += W) (Vec::loadu(w + j) * Vec(inv)).store(w + j);
  for (; j < V; ++j) w[j] *= inv;
}

// min-p: w [V] (normalised) keeps the tokens of at least min_p times its top probability
void keep_likely(float* w, int64_t V, float min_p) {
  Vec mv(0.f);
  int64_t j = 0;
  for (; j + W <= V; j += W) mv = at::vec::maximum(mv, Vec::loadu(w + j));
  float top = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, mv);
  for (; j < V; ++j) top = std::max(top, w[j]);
  const float bar = min_p * top;
  const __m256 bv = _mm256_set1_ps(bar);
  for (j = 0; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(w + j);
    _mm256_storeu_ps(w + j, _mm256_and_ps(v, _mm256_cmp_ps(v, bv, _CMP_GE_OQ)));
  }
  for (; j < V; ++j)
    if (!(w[j] >= bar)) w[j] = 0.f;
}

// a thread's scratch rows for a vocabulary of V (no allocation a call)
struct Scratch {
  std::vector<float> p, residual;
  Row row;
};

Scratch& scratch(int64_t V) {
  thread_local Scratch s;
  if (static_cast<int64_t>(s.p.size()) < V) s.p.resize(V);
  if (static_cast<int64_t>(s.residual.size()) < V) s.residual.resize(V);
  return s;
}

// one row: x [V] -> w [V], its probabilities with row s's parameters (z, the scaled logits, made in w itself); min-p
// last, as sampling._min_p: the tokens of at least min_p times the top probability, renormalised
void row_probs(const float* x, int64_t V, const Params& P, int64_t s, float* w, Row& r) {
  const float t = P.t.data_ptr<float>()[s], p = P.p.data_ptr<float>()[s], min_p = P.m.data_ptr<float>()[s];
  const int64_t k = P.k.data_ptr<int64_t>()[s];
  const float m = scaled(x, V, t, w);
  weights(w, V, m, w);
  if ((k > 0 && k < V) || p < 1.f) {
    r.reset(x, t, w, V);
    cut(r, k, p);
  }
  normalise(w, V);
  if (min_p > 0.f) {
    keep_likely(w, V, min_p);
    normalise(w, V);
  }
}

// logits [S, ..., V] -> probabilities [S, ..., V] float32, row s's positions with its parameters
at::Tensor cut_probs(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                     const at::Tensor& top_p, const at::Tensor& min_p) {
  const at::Tensor x = as_dense(logits);
  TORCH_CHECK(x.dim() >= 2, "cut_probs: logits must be [S, ..., V]");
  const Params P(temperature, top_k, top_p, min_p);
  const int64_t S = x.size(0), V = x.size(-1), R = x.numel() / std::max<int64_t>(V, 1);
  TORCH_CHECK(P.rows() == S, "cut_probs: parameters per row");
  const int64_t positions = S ? R / S : 1;
  at::Tensor out = at::detail::empty_cpu(x.sizes(), at::kFloat, false, std::nullopt);  // not dispatched
  Scratch& sc = scratch(V);
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) row_probs(in + r * V, V, P, r / positions, o + r * V, sc.row);
  return out;
}

// sampling.inverse_cdf: the token x with C(x - 1) <= u C(V) < C(x), C the running sums in float64 of probs [V]
// (float32), found a block of DRAW_BLOCK tokens at a time; the last token with mass where rounding puts u C(V) at
// a sum's end
constexpr int64_t DRAW_BLOCK = 128;

double block_sum(const float* x, int64_t n) {
  double a[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t j = 0;
  for (; j + 4 <= n; j += 4)
    for (int u = 0; u < 4; ++u) a[u] += x[j + u];
  for (; j < n; ++j) a[0] += x[j];
  return (a[0] + a[1]) + (a[2] + a[3]);
}

int64_t inverse_cdf_of(const float* x, int64_t V, double u) {
  const int64_t nb = (V + DRAW_BLOCK - 1) / DRAW_BLOCK;
  std::vector<double> cb(nb);  // running sums up to the end of each block
  double run = 0.0;
  int64_t last = 0;  // the last block with mass
  for (int64_t b = 0; b < nb; ++b) {
    const double s = block_sum(x + b * DRAW_BLOCK, std::min(DRAW_BLOCK, V - b * DRAW_BLOCK));
    run += s;
    cb[b] = run;
    if (s > 0.0) last = b;
  }
  const double v = u * run;
  int64_t b = std::upper_bound(cb.begin(), cb.end(), v) - cb.begin();
  b = std::min(b, last);
  double acc = b ? cb[b - 1] : 0.0;
  const int64_t lo = b * DRAW_BLOCK, hi = std::min(V, lo + DRAW_BLOCK);
  int64_t pick = -1, last_mass = lo;
  for (int64_t i = lo; i < hi; ++i) {
    if (x[i] > 0.f) last_mass = i;
    acc += x[i];
    if (pick < 0 && v < acc) pick = i;
  }
  return pick < 0 ? last_mass : std::min(pick, last_mass);
}

int64_t inverse_cdf(const at::Tensor& probs, double u) {
  TORCH_CHECK(probs.dim() == 1 && probs.scalar_type() == at::kFloat, "inverse_cdf: probs must be a float32 [V] tensor");
  const at::Tensor c = probs.contiguous();
  return inverse_cdf_of(c.data_ptr<float>(), c.numel(), u);
}

// one uniform in [0, 1) from a CPU generator, the value torch.rand(1, dtype=torch.float64, generator=g) gives
double uniform64(at::Generator& g) {
  auto* gen = at::check_generator<at::CPUGeneratorImpl>(g);
  std::lock_guard<std::mutex> lock(gen->mutex_);
  at::uniform_real_distribution<double> uniform(0.0, 1.0);
  return uniform(gen);
}

// sampling.sample on the CPU: one token per row of probs [B, V] (float32), row b with generators[b]
std::vector<int64_t> draw_rows(const at::Tensor& probs, std::vector<at::Generator> generators) {
  const at::Tensor c = as_dense(probs);
  const int64_t V = c.size(-1);
  TORCH_CHECK(c.numel() == V * static_cast<int64_t>(generators.size()), "draw_rows: probs [B, V], a generator a row");
  std::vector<int64_t> ids(generators.size());
  for (size_t b = 0; b < generators.size(); ++b)
    ids[b] = inverse_cdf_of(c.data_ptr<float>() + b * V, V, uniform64(generators[b]));
  return ids;
}

// sampling.sample_from_logits on the CPU: logits [B, V] (or [B, 1, V]) -> each row's probabilities (row_probs, what
// cut_probs makes) and one draw a row (draw_rows); temperature, top_p [B] float32, top_k [B] int64. The probabilities
// go to a new [B, V] tensor, or with ``out`` [B, n, V] (float32, contiguous) to out[:, step], returned as it is. With
// ``vocab_map`` [V] (int64: the output column of each logit's token, a drafter's vocabulary inside the target's),
// each row's probabilities go to those columns of out[:, step] [B, n, V_out] (zero elsewhere) and the ids drawn are
// mapped too.
std::tuple<at::Tensor, std::vector<int64_t>> sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                                                        const at::Tensor& top_k, const at::Tensor& top_p,
                                                        const at::Tensor& min_p, std::vector<at::Generator> generators,
                                                        const std::optional<at::Tensor>& out, int64_t step,
                                                        const std::optional<at::Tensor>& vocab_map) {
  const at::Tensor x = as_dense(logits);
  const Params P(temperature, top_k, top_p, min_p);
  const int64_t B = x.dim() ? x.size(0) : 0, V = x.dim() ? x.size(-1) : 0;
  TORCH_CHECK((x.dim() == 2 || (x.dim() == 3 && x.size(1) == 1)) && B == static_cast<int64_t>(generators.size()) &&
              P.rows() == B, "sample_rows: logits [B, V], parameters and generators per row");
  const bool mapped = vocab_map.has_value();
  TORCH_CHECK(!mapped || out.has_value(), "sample_rows: a vocab_map needs out");
  at::Tensor probs;
  int64_t V_out = V, stride = V, offset = 0;  // row b's probabilities at b * stride + offset
  if (out.has_value()) {
    probs = *out;
    V_out = probs.dim() == 3 ? probs.size(2) : -1;
    TORCH_CHECK(probs.dim() == 3 && probs.size(0) == B && (mapped || V_out == V) && step >= 0 &&
                step < probs.size(1) && probs.scalar_type() == at::kFloat && probs.is_contiguous(),
                "sample_rows: out must be a contiguous float32 [B, n, V] tensor and step within 0..n-1");
    stride = probs.size(1) * V_out, offset = step * V_out;
  } else {
    probs = at::detail::empty_cpu({B, V}, at::kFloat, false, std::nullopt);  // not dispatched
  }
  const int64_t* map = nullptr;
  at::Tensor map_t;
  if (mapped) {
    map_t = as_dense(*vocab_map, true);
    TORCH_CHECK(map_t.numel() == V, "sample_rows: vocab_map must hold one output column per logit");
    map = map_t.data_ptr<int64_t>();
    const auto [lo, hi] = std::minmax_element(map, map + V);
    TORCH_CHECK(V == 0 || (*lo >= 0 && *hi < V_out), "sample_rows: vocab_map's columns must lie in out's last dim");
  }
  Scratch& sc = scratch(V);
  std::vector<int64_t> ids(B);
  for (int64_t b = 0; b < B; ++b) {
    float* o = probs.data_ptr<float>() + b * stride + offset;
    float* w = mapped ? sc.p.data() : o;
    row_probs(x.data_ptr<float>() + b * V, V, P, b, w, sc.row);
    const int64_t j = inverse_cdf_of(w, V, uniform64(generators[b]));
    if (mapped) {
      std::fill(o, o + V_out, 0.f);
      for (int64_t c = 0; c < V; ++c) o[map[c]] = w[c];
    }
    ids[b] = mapped ? map[j] : j;
  }
  return {probs, ids};
}

// verify.rejection_sample for row b of a batch on the CPU, in one call: draft_ids [B, k] (int64), draft_probs [B, k, V]
// (float32; None: one-hot drafts), n: row b's drafts, the target's logits [B, k + 1, V] and the rows' sampling parameters
// [B]. Each p_i is made from its logits when the rule reads it (row_probs, as cut_probs makes it), up to the first
// rejection. The same draws in the same order as the Python rule: a row whose drafts are one-hot one draw per token it
// emits (verify._exact_match), any other n float32 uniforms, then one draw from the residual at the first rejection
// or from the bonus p (verify._accept_or_recover_row). Returns (accepted drafts, the recovered or bonus token).
std::tuple<int64_t, int64_t> verify_row(const at::Tensor& target_logits, const at::Tensor& draft_ids,
                                        const std::optional<at::Tensor>& draft_probs, int64_t n,
                                        const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                                        const at::Tensor& min_p, int64_t b, at::Generator generator) {
  const at::Tensor logits = as_dense(target_logits), ids = as_dense(draft_ids, true);
  TORCH_CHECK(logits.dim() == 3 && ids.dim() == 2 && logits.size(0) == ids.size(0) && logits.size(1) == ids.size(1) + 1 &&
              b >= 0 && b < logits.size(0), "verify_row: target logits [B, k + 1, V], draft ids [B, k], a row b < B");
  const int64_t k = ids.size(1), V = logits.size(2);
  TORCH_CHECK(n >= 0 && n <= k, "verify_row: the row's draft count must be within 0..k");
  const Params P(temperature, top_k, top_p, min_p);
  const float* row_logits = logits.data_ptr<float>() + b * (k + 1) * V;
  const int64_t* x = ids.data_ptr<int64_t>() + b * k;
  Scratch& sc = scratch(V);
  if (static_cast<int64_t>(sc.p.size()) < (k + 1) * V) sc.p.resize((k + 1) * V);
  float* ps = sc.p.data();  // [k + 1, V]: p_i in row i once made
  int64_t made = 0;  // p_0 .. p_{made - 1} made
  auto probs_at = [&](int64_t i) -> const float* {  // p_i, made two at a time on torch's threads (up to p_n)
    if (i >= made) {
      const int64_t end = std::min<int64_t>(i + 2, n + 1);
      at::parallel_for(i, end, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) row_probs(row_logits + j * V, V, P, b, ps + j * V, scratch(V).row);
      });
      made = end;
    }
    return ps + i * V;
  };
  const float* q = nullptr;  // [k, V], this row's q_i
  bool one_hot = true;
  if (draft_probs.has_value()) {
    const at::Tensor qs = as_dense(*draft_probs);
    TORCH_CHECK(qs.dim() == 3 && qs.size(0) == logits.size(0) && qs.size(1) == k && qs.size(2) == V,
                "verify_row: draft probs [B, k, V]");
    q = qs.data_ptr<float>() + b * k * V;
    for (int64_t i = 0; i < n && one_hot; ++i) {  // q_i is one-hot(x_i): q_i(x_i) is 1 and no other token has mass
      const float* qi = q + i * V;
      if (qi[x[i]] != 1.f) one_hot = false;
      for (int64_t j = 0; j < V && one_hot; ++j) one_hot = j == x[i] || qi[j] <= 0.f;
    }
  }
  if (one_hot) {  // y_i ~ p_i, accepted while y_i == x_i (verify._exact_match)
    for (int64_t i = 0;; ++i) {
      const int64_t y = inverse_cdf_of(probs_at(i), V, uniform64(generator));
      if (i >= n || y != x[i]) return {i, y};
    }
  }
  std::vector<float> bars(n);  // u_i q_i(x_i), float32 products as torch makes them
  {
    auto* gen = at::check_generator<at::CPUGeneratorImpl>(generator);
    std::lock_guard<std::mutex> lock(gen->mutex_);
    at::uniform_real_distribution<float> uniform(0.f, 1.f);
    for (int64_t i = 0; i < n; ++i) bars[i] = static_cast<float>(uniform(gen)) * q[i * V + x[i]];
  }
  int64_t accepted = n;
  for (int64_t i = 0; i < n; ++i) {
    if (!(bars[i] < probs_at(i)[x[i]])) {
      accepted = i;
      break;
    }
  }
  const float* p = probs_at(accepted);  // the bonus distribution p_n, or p at the first rejection
  if (accepted < n) {  // the residual max(0, p - q) there, drawn from as it is (its scale does not change a draw)
    const float* qa = q + accepted * V;
    float* residual = sc.residual.data();
    const __m256 zero = _mm256_setzero_ps();
    Sum64 sum;
    int64_t j = 0;
    for (; j + 8 <= V; j += 8) {
      const __m256 r = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_loadu_ps(qa + j)), zero);
      _mm256_storeu_ps(residual + j, r);
      sum.add(r);
    }
    double mass = sum.total();
    for (; j < V; ++j) mass += residual[j] = std::max(p[j] - qa[j], 0.f);
    if (mass > 0.0) return {accepted, inverse_cdf_of(residual, V, uniform64(generator))};  // else p, against rounding
  }
  return {accepted, inverse_cdf_of(p, V, uniform64(generator))};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("verify_row", &verify_row);
  m.def("cut_probs", &cut_probs);
  m.def("inverse_cdf", &inverse_cdf);
  m.def("draw_rows", &draw_rows);
  m.def("sample_rows", &sample_rows, pybind11::arg("logits"), pybind11::arg("temperature"), pybind11::arg("top_k"),
        pybind11::arg("top_p"), pybind11::arg("min_p"), pybind11::arg("generators"),
        pybind11::arg("out") = pybind11::none(), pybind11::arg("step") = 0,
        pybind11::arg("vocab_map") = pybind11::none());
}
"""

WHAT = "the sampling kernel"


def available() -> native.Availability:
    """Whether this CPU and install run the sampling kernel (building it the first time), and why not."""
    return _load()[1]


def module():
    """The built kernel (its functions take tensors and generators through pybind11, not the dispatcher)."""
    ext, ok = _load()
    if ext is None:
        raise RuntimeError(f"{WHAT} is unavailable: {ok.reason}")
    return ext


@functools.cache
def _load() -> tuple[object | None, native.Availability]:
    return native.module_availability(lambda: native.build("sampling_kernel", _SOURCE, WHAT, python_module=True), WHAT)


def cut_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor) -> torch.Tensor:
    """logits [S, ..., V] (CPU) with each row's temperature, top_k, top_p, min_p [S] -> probabilities [S, ..., V] float32."""
    return module().cut_probs(logits, temperature, top_k, top_p, min_p)
