// The Python module: one binding per kernel (nanoserve/kernels.py loads it).
#include "nanoserve.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention, read in place (CPU)");
  py::class_<DecodeWindow>(m, "DecodeWindow", "a decode step's window and context lengths, checked once")
      .def(py::init([](torch::Tensor window, torch::Tensor lens) { return check_window(window, lens); }),
           py::arg("window"), py::arg("context_lens"))
      .def_readonly("reach", &DecodeWindow::reach, "1 + the largest slot a row reads");
  m.def("decode_attention_checked", &decode_attention_checked,
        "decode_attention over a DecodeWindow: O(1) checks of the pools, no rescan of the window");
  m.def("isa", &isa, "the instructions fp32 decode attention with head_dim 64 was built for");
  m.def("has_tiles", &has_tiles, "whether the int8 tiles kernel (AVX512-VNNI) was built");
  m.def("quant_linear", &quant_linear, "x @ W.T with W as fp32 rows or GGUF blocks (CPU)");
  m.def("dequantize", &dequantize, "W as fp32, (out, in)");
  m.def("embed_rows", &embed_rows, "rows ids of W as fp32, (len(ids), in)", py::arg("ids"), py::arg("w"),
        py::arg("kind"), py::arg("in_features"), py::arg("rows") = -1);
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "logits[rows[i], t] = -inf wherever bit t of bitmask row i is clear (a grammar's mask), in place",
        py::arg("logits"), py::arg("rows"), py::arg("bitmask"));
  m.def("fused_decode", &fused_decode, "one whole decode step of a Llama, Qwen or Gemma 3 in one call (CPU)",
        py::arg("ids"), py::arg("positions"), py::arg("write_slots"), py::arg("window"), py::arg("context_lens"),
        py::arg("mats"), py::arg("kinds"), py::arg("norms"), py::arg("k_pools"), py::arg("v_pools"), py::arg("cos"),
        py::arg("sin"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
        py::arg("vocab"), py::arg("eps"), py::arg("int8"), py::arg("parts") = std::vector<int64_t>(),
        py::arg("part_rows") = std::vector<int64_t>(), py::arg("biases") = std::vector<torch::Tensor>(),
        py::arg("qk_norms") = std::vector<torch::Tensor>(), py::arg("out_norms") = std::vector<torch::Tensor>(),
        py::arg("gelu") = false, py::arg("embed_scale") = 1.0, py::arg("attn_scale") = 0.0,
        py::arg("sliding") = std::vector<int64_t>(), py::arg("local") = std::vector<torch::Tensor>());
}
