// Weight-only quantized linear layers for x86 CPUs with AVX2 + FMA (see quant.py).
//
// Both kernels compute y[m, n] = sum_k x[m, k] * w[n, k] in float32 over weights stored in
// blocks of 32 along k (the GGUF Q4_1 and Q8_0 layouts):
//
//   q4: w[n, 32g + j] = d[n, g] * q + mn[n, g]   q = qs[n, g, j] & 15         (j < 16)
//                                                 q = qs[n, g, j - 16] >> 4   (j >= 16)
//   q8: w[n, 32g + j] = d[n, g] * qs[n, 32g + j]  (qs int8)
//
// Each weight row is first decoded into a float32 row buffer (fma(d, q, mn) rounds once, like
// d * q + mn with an exact product, so the decoded row equals the reference dequantization bit
// for bit), then dotted with every row of x. The dot product uses four 8-lane accumulators in a
// fixed order that depends only on k, so y[m, n] does not depend on the other rows of x or on how
// the rows are split across threads: the kernels are batch invariant.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  lo = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, lo);
  return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

// sum_k x[k] * w[k] for k < K (K a multiple of 32), fixed order.
inline float dot32(const float* x, const float* w, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; k += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(w + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), _mm256_loadu_ps(w + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), _mm256_loadu_ps(w + k + 24), a3);
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

inline __m256 u8x8_to_ps(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }

// Decode one q4 row (K / 32 blocks of 16 bytes) into out[K].
inline void decode_q4_row(const uint8_t* qs, const float* d, const float* mn, int64_t K, float* out) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < K / 32; ++g) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * g));
    const __m128i lo = _mm_and_si128(raw, low);                     // elements 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);  // elements 16..31
    const __m256 dv = _mm256_set1_ps(d[g]), mv = _mm256_set1_ps(mn[g]);
    float* o = out + 32 * g;
    _mm256_storeu_ps(o, _mm256_fmadd_ps(dv, u8x8_to_ps(lo), mv));
    _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(dv, u8x8_to_ps(_mm_srli_si128(lo, 8)), mv));
    _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(dv, u8x8_to_ps(hi), mv));
    _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(dv, u8x8_to_ps(_mm_srli_si128(hi, 8)), mv));
  }
}

// Decode one q8 row (K int8 values, K / 32 scales) into out[K].
inline void decode_q8_row(const int8_t* qs, const float* d, int64_t K, float* out) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const __m256 dv = _mm256_set1_ps(d[g]);
    for (int c = 0; c < 4; ++c) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 32 * g + 8 * c));
      _mm256_storeu_ps(out + 32 * g + 8 * c, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))));
    }
  }
}

template <typename Decode>
torch::Tensor run(const torch::Tensor& x, int64_t N, int64_t K, Decode decode) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K, "x must be float32 [M, K]");
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      decode(n, row.data());
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot32(xp + m * K, row.data(), K);
    }
  });
  return y;
}

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor mn) {
  const int64_t N = qs.size(0), K = qs.size(1) * 2;
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous() && mn.is_contiguous(), "weights must be contiguous");
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = mn.data_ptr<float>();
  return run(x, N, K, [&](int64_t n, float* out) {
    decode_q4_row(q + n * (K / 2), dp + n * (K / 32), mp + n * (K / 32), K, out);
  });
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  const int64_t N = qs.size(0), K = qs.size(1);
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous(), "weights must be contiguous");
  const int8_t* q = qs.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  return run(x, N, K, [&](int64_t n, float* out) { decode_q8_row(q + n * K, dp + n * (K / 32), K, out); });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "x [M, K] float32 @ q4 weight [N, K].T");
  m.def("q8_linear", &q8_linear, "x [M, K] float32 @ q8 weight [N, K].T");
}
