// A whole decode step of a llama-family model on the CPU in one call: every decoder layer and the
// final norm, on GGUF integer-dot weights (qdot_kernels.h) and the decode kernels
// (cpu_decode_kernels.h). Python builds a DecodeStep once per model (runtime/models/cpu_decode.py)
// and calls run() per step; the layer loop then costs no Python and no torch dispatch.
//
// run() calls the same kernels, in the same order, as the module-by-module path of
// runtime/models/llama.py does through Python, so both give the same bits:
//
//   layer 0:  residual = x;                 h = rms_norm(x)
//   layer i:  (h, residual) = add_rms_norm(x, residual)
//             qkv = qkv_proj(h); attn = decode_attention(q, k, v)   (RoPE, pool write, attention)
//             (h, residual) = add_rms_norm(o_proj(attn), residual)
//             x = down_proj(silu_and_mul(gate_up_proj(h)))
//   end:      norm(x + residual)
//
// One row per request (decode). The Python side checks what the step covers (no biases, no q/k
// norms, float32, one rank) and keeps the module path for everything else.

#pragma once

#include "cpu_decode_kernels.h"
#include "qdot_kernels.h"

#include <vector>

namespace {

struct Projection {
  torch::Tensor packed;  // uint8 [T, K / 32, record] (qdot.py's pack_q4 / pack_q8)
  int64_t n = 0;         // output features
  bool q4 = true;        // Q4_1 blocks, else Q8_0

  torch::Tensor operator()(const torch::Tensor& x) const {
    return q4 ? qdot<true>(x, packed, n) : qdot<false>(x, packed, n);
  }
};

struct DecoderLayer {
  torch::Tensor input_norm, post_norm;  // float32 [H]
  Projection qkv, o, gate_up, down;
  torch::Tensor k_buf, v_buf;  // this layer's KV pool, float32 [S, Hk, D]
};

class DecodeStep {
 public:
  DecodeStep(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
             torch::Tensor final_norm)
      : hq_(num_heads), hk_(num_kv_heads), d_(head_dim), eps_(eps), scale_(scale), final_norm_(final_norm) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, std::vector<torch::Tensor> packed,
                 std::vector<int64_t> n, std::vector<bool> q4, torch::Tensor k_buf, torch::Tensor v_buf) {
    TORCH_CHECK(packed.size() == 4 && n.size() == 4 && q4.size() == 4, "a layer has four projections");
    Projection p[4];
    for (int i = 0; i < 4; ++i) p[i] = Projection{packed[i], n[i], q4[i]};
    TORCH_CHECK(p[0].n == (hq_ + 2 * hk_) * d_, "qkv projection has ", p[0].n, " outputs");
    layers_.push_back(DecoderLayer{input_norm, post_norm, p[0], p[1], p[2], p[3], k_buf, v_buf});
  }

  // x: embeddings [B, H]; the attention tables as decode_attention takes them; cos/sin [B, D / 2].
  // Returns the final hidden states [B, H] (after the model's last norm).
  torch::Tensor run(torch::Tensor x, torch::Tensor out_slots, torch::Tensor req_to_token, torch::Tensor req,
                    torch::Tensor seq_lens, torch::Tensor cos, torch::Tensor sin) const {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [B, H]");
    const int64_t B = x.size(0), qn = hq_ * d_, kn = hk_ * d_;
    torch::Tensor h = x, residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecoderLayer& l = layers_[i];
      torch::Tensor normed;
      if (i == 0) {
        residual = h;
        normed = rms_norm_impl(h, nullptr, l.input_norm, eps_)[0];
      } else {
        auto r = rms_norm_impl(h, &residual, l.input_norm, eps_);
        normed = r[0];
        residual = r[1];
      }
      const torch::Tensor qkv = l.qkv(normed);
      const torch::Tensor attn = decode_attention(
          qkv.narrow(1, 0, qn).view({B, hq_, d_}), qkv.narrow(1, qn, kn).view({B, hk_, d_}),
          qkv.narrow(1, qn + kn, kn).view({B, hk_, d_}), l.k_buf, l.v_buf, out_slots, req_to_token, req,
          seq_lens, cos, sin, scale_);
      auto r = rms_norm_impl(l.o(attn.view({B, qn})), &residual, l.post_norm, eps_);
      residual = r[1];
      h = l.down(silu_and_mul(l.gate_up(r[0])));
    }
    if (layers_.empty()) return rms_norm_impl(h, nullptr, final_norm_, eps_)[0];
    return rms_norm_impl(h, &residual, final_norm_, eps_)[0];
  }

 private:
  int64_t hq_, hk_, d_;
  double eps_, scale_;
  torch::Tensor final_norm_;
  std::vector<DecoderLayer> layers_;
};

}  // namespace
