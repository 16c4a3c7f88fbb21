// Integer-dot linear layers on GGUF blocks for x86 CPUs (see qdot.py); bound in qdot_kernels.cpp.
//
// y[m, n] = sum over blocks g of 32 along k of the block's integer dot product of the weight's
// quants with the activation's quants, scaled in float32:
//
//   q4 (GGUF Q4_1, w = dw * q + mw, q in [0, 15]):
//     y += float(sum_j q[j] * xq[j]) * (dw * dx);  y += mw * sx
//   q8 (GGUF Q8_0, w = dw * q, q in [-127, 127]):
//     y += float(sum_j q[j] * xq[j]) * (dw * dx)
//
// Activations are quantized here, per row and block of 32, symmetrically to int8:
//   dx = max|x| / 127, xq = round_half_even(x * (1 / dx)) (0 where dx is 0), sx = dx * sum_j xq[j].
// The integer sums are exact, and the float steps run in this fixed order (compiled with
// -ffp-contract=off, so no step is fused), so qdot.py's torch reference gives the same bits.
//
// Weights are repacked once at load (qdot.py) into tiles of 8 output rows. A tile's block g is
// one contiguous record, and a thread walks its tiles' records in memory order:
//   q4: 128 bytes of quants, 16 bytes dw (8 x f16), 16 bytes mw (8 x f16)          = 160 bytes
//       quant byte 32p + 4r + e: low nibble element 4p + e of row r, high nibble 16 + 4p + e
//   q8: 256 bytes of quants, 16 bytes dw (8 x f16)                                  = 272 bytes
//       quant byte 32c + 4r + e: element 4c + e of row r
// So one 32-byte load holds 4 consecutive elements of each of the 8 rows, and a multiply-add of
// unsigned by signed bytes against the activation's 4 elements (broadcast) leaves each row's
// partial sum in its own int32 lane: no horizontal sums, and the scales apply to 8 rows at once.
//
// The byte dot product is _mm256_dpbusd_epi32 when built with PHLOEM_QDOT_VNNI (AVX-512 VNNI +
// VL, one instruction), else _mm256_maddubs_epi16 + _mm256_madd_epi16 (AVX2); both give the same
// exact int32 sums. Output rows are split across threads by whole tiles, with no barrier inside.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>

namespace {

constexpr int64_t kRows = 8;       // output rows per tile
constexpr int64_t kQ4Record = 160;  // bytes per tile and block
constexpr int64_t kQ8Record = 272;
constexpr int64_t kMaxRowsAtOnce = 8;  // activation rows sharing one decode of a weight record (a
                                       // verify pass of up to 8 draft tokens reads each tile once)

#ifdef PHLOEM_QDOT_VNNI
inline __m256i dot4(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#else
inline __m256i dot4(__m256i acc, __m256i u8, __m256i s8) {
  // pairs of u8 * s8 products fit int16 here: |q| <= 127 and |xq| <= 127 (2 * 127 * 127 < 32767)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}
#endif

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256 half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Quantize one row of K floats: xq[K], dx[K / 32], sx[K / 32].
void quantize_row(const float* x, int64_t K, int8_t* xq, float* dx, float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < K / 32; ++g) {
    const float* b = x + 32 * g;
    __m256 amax = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(b + 8 * c)));
    float lanes[8];
    _mm256_storeu_ps(lanes, amax);
    float mx = 0.0f;
    for (float v : lanes) mx = v > mx ? v : mx;
    const float d = mx / 127.0f;
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(b + 8 * c), iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
      const __m256i qi = _mm256_cvtps_epi32(q);
      sum = _mm256_add_epi32(sum, qi);
      // int32 -> int8 (values fit): pack to int16, then int8, undoing the lane interleave
      const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
      const __m128i w8 = _mm_packs_epi16(w16, w16);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(xq + 32 * g + 8 * c), w8);
    }
    int32_t s[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s), sum);
    int32_t total = 0;
    for (int32_t v : s) total += v;
    dx[g] = d;
    sx[g] = d * static_cast<float>(total);
  }
}

// One tile (8 output rows) for MB activation rows starting at xq: out[i * N + r].
template <bool Q4, int MB>
inline void tile(const uint8_t* rec, int64_t G, const int8_t* xq, const float* dx, const float* sx, int64_t K,
                 float* out, int64_t N, int64_t rows_here) {
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g, rec += Q4 ? kQ4Record : kQ8Record) {
    if constexpr (Q4) {
      __m256i w[8];  // w[p]: elements 4p..4p+3, w[4 + p]: elements 16+4p..16+4p+3
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * p));
        w[p] = _mm256_and_si256(v, low);
        w[4 + p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const __m256 dw = half8(rec + 128), mw = half8(rec + 144);
      for (int i = 0; i < MB; ++i) {
        const int8_t* xb = xq + i * K + 32 * g;
        __m256i s = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) s = dot4(s, w[c], bcast4(xb + 4 * c));
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(dx[i * (K / 32) + g]));
        acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(s), scale));
        acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(mw, _mm256_set1_ps(sx[i * (K / 32) + g])));
      }
    } else {
      __m256i wa[8], ws[8];  // |q| and q's signs, applied to the activation
      for (int c = 0; c < 8; ++c) {
        ws[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * c));
        wa[c] = _mm256_abs_epi8(ws[c]);
      }
      const __m256 dw = half8(rec + 256);
      for (int i = 0; i < MB; ++i) {
        const int8_t* xb = xq + i * K + 32 * g;
        __m256i s = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) s = dot4(s, wa[c], _mm256_sign_epi8(bcast4(xb + 4 * c), ws[c]));
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(dx[i * (K / 32) + g]));
        acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(s), scale));
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    if (rows_here == kRows) {
      _mm256_storeu_ps(out + i * N, acc[i]);
    } else {
      float tmp[kRows];
      _mm256_storeu_ps(tmp, acc[i]);
      std::memcpy(out + i * N, tmp, sizeof(float) * rows_here);
    }
  }
}

template <bool Q4>
torch::Tensor qdot(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
  const int64_t record = Q4 ? kQ4Record : kQ8Record;
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 3 && packed.size(2) == record &&
                  packed.is_contiguous(), "packed weight must be uint8 [T, K / 32, record], contiguous");
  const int64_t T = packed.size(0), G = packed.size(1), K = 32 * G;
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(N > kRows * (T - 1) && N <= kRows * T, "N does not match the tile count");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  if (M == 0) return y;
  auto xq = torch::empty({M, K}, torch::kInt8);
  auto scales = torch::empty({2, M, G}, torch::kFloat32);
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* dxp = scales.data_ptr<float>();
  float* sxp = dxp + M * G;
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, qp + m * K, dxp + m * G, sxp + m * G);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // a few tiles per task at least: a task must be worth waking a thread for
  const int64_t grain = std::max<int64_t>(1, 4096 / (G * 8 + 1));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* rec = w + t * G * record;
      const int64_t rows_here = std::min<int64_t>(kRows, N - kRows * t);
      float* out = yp + kRows * t;
      int64_t m = 0;
      for (; m + kMaxRowsAtOnce <= M; m += kMaxRowsAtOnce)
        tile<Q4, kMaxRowsAtOnce>(rec, G, qp + m * K, dxp + m * G, sxp + m * G, K, out + m * N, N, rows_here);
      switch (M - m) {
        case 7: tile<Q4, 7>(rec, G, qp + m * K, dxp + m * G, sxp + m * G, K, out + m * N, N, rows_here); break;
        case 6: tile<Q4, 6>(rec, G, qp + m * K, dxp + m * G, sxp + m * G, K, out + m * N, N, rows_here); break;
        case 5: tile<Q4, 5>(rec, G, qp + m * K, dxp + m * G, sxp + m * G, K, out + m * N, N, rows_here); break;
        case 4: tile<Q4, 4>(rec, G, qp + m * K, dxp + m * G, sxp + m * G, K, out + m * N, N, rows_here); break;
        case 3: tile<Q4, 3>(rec, G, qp + m * K, dxp + m * G, sxp + m * G, K, out + m * N, N, rows_here); break;
        case 2: tile<Q4, 2>(rec, G, qp + m * K, dxp + m * G, sxp + m * G, K, out + m * N, N, rows_here); break;
        case 1: tile<Q4, 1>(rec, G, qp + m * K, dxp + m * G, sxp + m * G, K, out + m * N, N, rows_here); break;
        default: break;
      }
    }
  });
  return y;
}

}  // namespace
