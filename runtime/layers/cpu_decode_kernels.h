// CPU decode-step kernels: one decode attention layer in one call (runtime/attention/cpu.py),
// RMSNorm with its residual add (runtime/layers/rmsnorm.py) and SiLU x mul (activation.py), each
// replacing several torch ops whose per-op cost dominates a small model's decode step. Bound for
// Python in cpu_decode_kernels.cpp; qdot_kernels.cpp's whole-step decode calls them directly.
//
// Attention:
// For each request b (one new token):
//   1. RoPE (rotate-half) on q[b] and k[b], in the float order of rotary.rope_ref:
//        out1 = x1 * cos - x2 * sin,  out2 = x2 * cos + x1 * sin
//   2. the rotated k[b] and v[b] written into the pool at out_slots[b]
//   3. every query head attends over the request's slots req_to_token[req[b], 0 : seq_lens[b]]
//      read in place from the pool (no gathered copy): scores 8 keys at a time, a max-subtracted
//      softmax with a vectorized e^x, and the weighted sum of V held in registers.
// Work is split over (request, query head) pairs; a pair is one task, so there is no barrier
// inside a layer beyond the parallel region's end, and one request's heads use every thread.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  float s = _mm_cvtss_f32(lo);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t n) {  // y += a * x
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// e^x, 8 lanes, for x in [-87, 88]: x = n ln2 + r, e^r by a degree-6 polynomial on
// |r| <= ln2 / 2, 2^n built in the exponent bits. Within 2 ulp of expf; 0 below -87.3.
inline __m256 exp_poly(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline __m256 exp_neg(__m256 x) { return exp_poly(_mm256_max_ps(x, _mm256_set1_ps(-87.0f))); }

// e^x for any x: 0 below -87, float's largest power of two times e^r above 88 (never inf, so
// silu's g / (1 + e^-g) stays finite and tends to 0 for very negative g)
inline __m256 exp_any(__m256 x) {
  return exp_poly(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)));
}

// the 8 horizontal sums of a[0..7] as one vector: lane j = sum of a[j]'s lanes
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// out[0 : 8 NV] = sum_j p[j] * v(row[j])[d0 : d0 + 8 NV], accumulated in registers
template <int NV>
inline void weighted_sum(const float* p, const float* v, int64_t stride, const int64_t* row, int64_t L, float* out) {
  __m256 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    const float* vr = v + row[j] * stride;
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * i), acc[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

// One query head over L keys and values read in place (k, v point at the head's first element of
// slot 0; `stride` floats from one slot to the next): scores, softmax, weighted sum. D % 8 == 0.
inline void attend_head(const float* q, const float* k, const float* v, int64_t stride, const int64_t* row,
                        int64_t L, int64_t D, float scale, float* sc, float* out) {
  const __m256 sv = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {  // 8 keys at once: one horizontal reduction for all eight
    __m256 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + row[j + u] * stride + d), acc[u]);
    }
    _mm256_storeu_ps(sc + j, _mm256_mul_ps(hsum8(acc), sv));
  }
  for (; j < L; ++j) sc[j] = dot(q, k + row[j] * stride, D) * scale;
  // softmax: max, then e^(s - max) in place, then the sum (normalized at the end, on D values)
  __m256 mv = _mm256_set1_ps(-INFINITY);
  j = 0;
  for (; j + 8 <= L; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + j));
  float lanes[8];
  _mm256_storeu_ps(lanes, mv);
  float mx = lanes[0];
  for (int u = 1; u < 8; ++u) mx = std::max(mx, lanes[u]);
  for (; j < L; ++j) mx = std::max(mx, sc[j]);
  for (int64_t t = L; t < ((L + 7) / 8) * 8; ++t) sc[t] = -INFINITY;  // pad the last 8 (e^-inf = 0)
  const __m256 m8 = _mm256_set1_ps(mx);
  __m256 tot = _mm256_setzero_ps();
  for (j = 0; j < L; j += 8) {
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sc + j), m8));
    _mm256_storeu_ps(sc + j, e);
    tot = _mm256_add_ps(tot, e);
  }
  _mm256_storeu_ps(lanes, tot);
  float total = 0.0f;
  for (float t : lanes) total += t;
  const float inv = 1.0f / total;
  for (j = 0; j < ((L + 7) / 8) * 8; ++j) sc[j] *= inv;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    switch (std::min<int64_t>(D - d0, 64) / 8) {
      case 8: weighted_sum<8>(sc, v + d0, stride, row, L, out + d0); break;
      case 7: weighted_sum<7>(sc, v + d0, stride, row, L, out + d0); break;
      case 6: weighted_sum<6>(sc, v + d0, stride, row, L, out + d0); break;
      case 5: weighted_sum<5>(sc, v + d0, stride, row, L, out + d0); break;
      case 4: weighted_sum<4>(sc, v + d0, stride, row, L, out + d0); break;
      case 3: weighted_sum<3>(sc, v + d0, stride, row, L, out + d0); break;
      case 2: weighted_sum<2>(sc, v + d0, stride, row, L, out + d0); break;
      default: weighted_sum<1>(sc, v + d0, stride, row, L, out + d0); break;
    }
  }
}

// dst[0 : D] = RoPE(src[0 : D]) with half tables cos, sin [D / 2]
inline void rope(const float* src, const float* cos, const float* sin, int64_t D, float* dst) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float x1 = src[i], x2 = src[h + i];
    const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], d = x1 * sin[i];
    dst[i] = a - b;
    dst[h + i] = c + d;
  }
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_buf,
                               torch::Tensor v_buf, torch::Tensor out_slots, torch::Tensor req_to_token,
                               torch::Tensor req, torch::Tensor seq_lens, torch::Tensor cos, torch::Tensor sin,
                               double scale) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hk = k.size(1);
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->dtype() == torch::kFloat32 && t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == D,
                "q, k, v must be float32 [B, H, D] with contiguous heads");
  TORCH_CHECK(k_buf.dtype() == torch::kFloat32 && k_buf.is_contiguous() && v_buf.is_contiguous() &&
                  k_buf.size(1) == Hk && k_buf.size(2) == D, "pool buffers must be float32 [S, Hk, D]");
  TORCH_CHECK(Hq % Hk == 0 && D % 8 == 0, "query heads must be a multiple of KV heads, head size of 8");
  auto table = req_to_token.contiguous();
  auto slots = out_slots.contiguous(), reqs = req.contiguous(), lens = seq_lens.contiguous();
  auto c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.numel() == B * D / 2 && s.numel() == B * D / 2, "cos/sin must be [B, D / 2]");
  auto out = torch::empty({B, Hq, D}, q.options());
  auto qr = torch::empty({B, Hq, D}, q.options());
  float* kb = k_buf.data_ptr<float>();
  float* vb = v_buf.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* rt = table.data_ptr<int64_t>();
  const int64_t* rq = reqs.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t ctx = table.size(1);
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* qp = qr.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* qin = q.data_ptr<float>();
  const float* kin = k.data_ptr<float>();
  const float* vin = v.data_ptr<float>();
  const int64_t qs0 = q.stride(0), ks0 = k.stride(0), vs0 = v.stride(0);
  const int64_t S = k_buf.size(0);

  // 1 + 2: RoPE and the pool write (small: B x (Hq + Hk) x D)
  for (int64_t b = 0; b < B; ++b) {
    const float* cb = cp + b * (D / 2);
    const float* sb = sp + b * (D / 2);
    for (int64_t h = 0; h < Hq; ++h) rope(qin + b * qs0 + h * D, cb, sb, D, qp + (b * Hq + h) * D);
    TORCH_CHECK(slot[b] >= 0 && slot[b] < S, "out slot out of range");
    for (int64_t h = 0; h < Hk; ++h) {
      rope(kin + b * ks0 + h * D, cb, sb, D, kb + (slot[b] * Hk + h) * D);
      std::memcpy(vb + (slot[b] * Hk + h) * D, vin + b * vs0 + h * D, sizeof(float) * D);
    }
  }

  // 3: attention per (request, query head): one task each, so a request's heads spread over the
  // threads even at batch 1
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, ln[b]);
  const int64_t group = Hq / Hk;
  const int64_t grain = std::max<int64_t>(1, 16384 / (longest * D + 1));
  at::parallel_for(0, B * Hq, grain, [&](int64_t p0, int64_t p1) {
    std::vector<float> scores(static_cast<size_t>(longest + 8));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / Hq, h = p % Hq, hk = h / group, L = ln[b];
      TORCH_CHECK(L >= 1 && L <= ctx, "sequence length out of range");
      const int64_t* row = rt + rq[b] * ctx;
      attend_head(qp + (b * Hq + h) * D, kb + hk * D, vb + hk * D, Hk * D, row, L, D,
                  static_cast<float>(scale), scores.data(), op + (b * Hq + h) * D);
    }
  });
  return out;
}

// out[m] = r[m] * (1 / sqrt(mean(r[m]^2) + eps)) * w, with r = x (+ residual, written back to
// new_residual). The sum of squares runs in 8 float lanes, one row per call: rows do not depend
// on each other (batch invariant).
std::vector<torch::Tensor> rms_norm_impl(const torch::Tensor& x, const torch::Tensor* residual,
                                         const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1, "x must be float32 [M, H]");
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.is_contiguous() && w.numel() == H, "weight must be float32 [H]");
  auto out = torch::empty({M, H}, x.options());
  torch::Tensor sum;
  const float* wp = w.data_ptr<float>();
  if (residual != nullptr) {
    TORCH_CHECK(residual->dtype() == torch::kFloat32 && residual->sizes() == x.sizes() && residual->stride(1) == 1,
                "residual must be float32 like x");
    sum = torch::empty({M, H}, x.options());
  }
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x.data_ptr<float>() + m * x.stride(0);
    const float* src = xr;
    if (residual != nullptr) {
      const float* rr = residual->data_ptr<float>() + m * residual->stride(0);
      float* sr = sum.data_ptr<float>() + m * H;
      for (int64_t i = 0; i < H; ++i) sr[i] = xr[i] + rr[i];
      src = sr;
    }
    const float ss = dot(src, src, H);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
    float* o = out.data_ptr<float>() + m * H;
    for (int64_t i = 0; i < H; ++i) o[i] = src[i] * inv * wp[i];
  }
  if (residual != nullptr) return {out, sum};
  return {out};
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) { return rms_norm_impl(x, nullptr, w, eps)[0]; }

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  return rms_norm_impl(x, &residual, w, eps);
}

// out[m, i] = silu(g[m, i]) * u[m, i] for gate_up = [g | u] rows [M, 2 I]: silu(g) = g / (1 + e^-g),
// with e^x vectorized (exp_any) in 8 float lanes. Each element depends only on its own inputs.
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dtype() == torch::kFloat32 && gate_up.dim() == 2 && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 16 == 0, "gate_up must be float32 [M, 2 I] with I % 8 == 0");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({M, I}, gate_up.options());
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gate_up.data_ptr<float>() + m * gate_up.stride(0);
    const float* u = g + I;
    float* o = out.data_ptr<float>() + m * I;
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 e = exp_any(_mm256_sub_ps(zero, gv));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
  }
  return out;
}

}  // namespace

