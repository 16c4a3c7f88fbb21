// CPU decode-step kernels: one decode attention layer in one call (runtime/attention/cpu.py),
// and RMSNorm with its residual add (runtime/layers/rmsnorm.py), each replacing several torch ops
// whose per-op cost dominates a small model's decode step.
//
// Attention:
// For each request b (one new token):
//   1. RoPE (rotate-half) on q[b] and k[b], in the float order of rotary.rope_ref:
//        out1 = x1 * cos - x2 * sin,  out2 = x2 * cos + x1 * sin
//   2. the rotated k[b] and v[b] written into the pool at out_slots[b]
//   3. every query head attends over the request's slots req_to_token[req[b], 0 : seq_lens[b]]
//      read in place from the pool (no gathered copy): scores, max-subtracted softmax, weighted
//      sum of V. The query heads of one KV head share each K/V row read.
// Work is split over (request, KV head) pairs; a pair is one task, so there is no barrier
// inside a layer beyond the parallel region's end.

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
  TORCH_CHECK(Hq % Hk == 0 && D % 2 == 0, "query heads must be a multiple of KV heads");
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

  // 3: attention per (request, KV head)
  const int64_t group = Hq / Hk;
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, ln[b]);
  const int64_t grain = std::max<int64_t>(1, 32768 / (longest * D * group + 1));
  at::parallel_for(0, B * Hk, grain, [&](int64_t p0, int64_t p1) {
    std::vector<float> scores(static_cast<size_t>(group * longest));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / Hk, hk = p % Hk, L = ln[b];
      TORCH_CHECK(L >= 1 && L <= ctx, "sequence length out of range");
      const int64_t* row = rt + rq[b] * ctx;
      for (int64_t j = 0; j < L; ++j) {
        const float* kr = kb + (row[j] * Hk + hk) * D;
        for (int64_t g = 0; g < group; ++g)
          scores[g * L + j] = dot(qp + (b * Hq + hk * group + g) * D, kr, D) * static_cast<float>(scale);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sc = scores.data() + g * L;
        float mx = sc[0];
        for (int64_t j = 1; j < L; ++j) mx = std::max(mx, sc[j]);
        float total = 0.0f;
        for (int64_t j = 0; j < L; ++j) {
          sc[j] = std::exp(sc[j] - mx);
          total += sc[j];
        }
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < L; ++j) sc[j] *= inv;
      }
      for (int64_t g = 0; g < group; ++g) std::fill_n(op + (b * Hq + hk * group + g) * D, D, 0.0f);
      for (int64_t j = 0; j < L; ++j) {
        const float* vr = vb + (row[j] * Hk + hk) * D;
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * L + j], vr, op + (b * Hq + hk * group + g) * D, D);
      }
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "RoPE, pool write and paged decode attention of one layer (float32 pool)");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows [M, H]");
  m.def("add_rms_norm", &add_rms_norm, "(RMSNorm(x + residual), x + residual) of float32 rows [M, H]");
}
