// Python bindings of the integer-dot kernels (qdot_kernels.h), and a whole decode step of a
// llama-family model on them (decode_step.h), built once per instruction set (qdot.py).

#include "decode_step.h"
#include "qdot_kernels.h"

namespace {

torch::Tensor q4_dot(torch::Tensor x, torch::Tensor packed, int64_t N) { return qdot<true>(x, packed, N); }
torch::Tensor q8_dot(torch::Tensor x, torch::Tensor packed, int64_t N) { return qdot<false>(x, packed, N); }

std::vector<torch::Tensor> quantize_activations(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) % 32 == 0, "x must be float32 [M, 32 G]");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto xq = torch::empty({M, K}, torch::kInt8);
  auto dx = torch::empty({M, K / 32}, torch::kFloat32);
  auto sx = torch::empty({M, K / 32}, torch::kFloat32);
  for (int64_t m = 0; m < M; ++m)
    quantize_row(xc.data_ptr<float>() + m * K, K, xq.data_ptr<int8_t>() + m * K, dx.data_ptr<float>() + m * (K / 32),
                 sx.data_ptr<float>() + m * (K / 32));
  return {xq, dx, sx};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_dot", &q4_dot, "x [M, K] float32 @ packed Q4_1 weight [N, K].T, int8 activations");
  m.def("q8_dot", &q8_dot, "x [M, K] float32 @ packed Q8_0 weight [N, K].T, int8 activations");
  m.def("quantize_activations", &quantize_activations, "x [M, K] -> (xq int8, dx, sx) per block of 32");
  pybind11::class_<DecodeStep>(m, "DecodeStep", "every decoder layer of one CPU decode step (decode_step.h)")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, torch::Tensor>())
      .def("add_layer", &DecodeStep::add_layer)
      .def("run", &DecodeStep::run, pybind11::call_guard<pybind11::gil_scoped_release>());
#ifdef PHLOEM_QDOT_VNNI
  m.attr("isa") = "avx512vnni";
#else
  m.attr("isa") = "avx2";
#endif
}
