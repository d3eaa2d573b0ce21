// The Python module: one binding per kernel (nanoserve/kernels.py loads it).
#include "nanoserve.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention, read in place (CPU)");
  m.def("isa", &isa, "the instructions fp32 decode attention with head_dim 64 was built for");
  m.def("has_tiles", &has_tiles, "whether the int8 tiles kernel (AVX512-VNNI) was built");
  m.def("quant_linear", &quant_linear, "x @ W.T with W as fp32 rows, Q4_1 or Q8_0 blocks (CPU)");
  m.def("dequantize", &dequantize, "W as fp32, (out, in)");
  m.def("embed_rows", &embed_rows, "rows ids of W as fp32, (len(ids), in)");
  m.def("fused_decode", &fused_decode, "one whole decode step of a Llama in one call (CPU)");
}
