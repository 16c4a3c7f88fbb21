// Python bindings of the CPU decode-step kernels (cpu_decode_kernels.h).

#include "cpu_decode_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "RoPE, pool write and paged decode attention of one layer (float32 pool)");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows [M, H]");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of float32 rows [M, 2 I]");
  m.def("add_rms_norm", &add_rms_norm, "(RMSNorm(x + residual), x + residual) of float32 rows [M, H]");
}
