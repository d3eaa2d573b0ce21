// What the native kernels export to each other and to Python (module.cpp binds them).
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

// paged_attention.cpp
// A decode step's window, checked once and then shared by its layers: each layer's call checks
// its pools against `reach` in O(1) instead of rescanning every slot of the window.
struct DecodeWindow {
  torch::Tensor window, context_lens;  // contiguous, (rows, width) and (rows,) int64; copies if kept
  int64_t reach = 0;                   // 1 + the largest slot a row reads: the pools need this many
  int64_t widest_row = -1;             // a row that reads slot reach - 1 (for the error message)
};
DecodeWindow check_window(torch::Tensor window, torch::Tensor context_lens, bool copy = true);
torch::Tensor decode_attention_checked(torch::Tensor q, torch::Tensor k, torch::Tensor v, const DecodeWindow& w,
                                       double scale);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor window,
                               torch::Tensor context_lens, double scale);
std::string isa();

// quant.cpp: weights as a GGUF holds them (kind 0 fp32 rows, 1 Q4_1 blocks, 2 Q8_0 blocks)
bool has_tiles();  // the tiles kernel (kinds 5, 6) was built: this CPU has AVX512-VNNI
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor w, int64_t kind, int64_t out_features, bool int8);
torch::Tensor dequantize(torch::Tensor w, int64_t kind, int64_t out_features, int64_t in_features);
torch::Tensor embed_rows(torch::Tensor ids, torch::Tensor w, int64_t kind, int64_t in_features, int64_t rows = -1);
torch::Tensor fused_decode(torch::Tensor ids, torch::Tensor positions, torch::Tensor write_slots,
                           torch::Tensor window, torch::Tensor context_lens,
                           std::vector<torch::Tensor> mats, std::vector<int64_t> kinds,
                           std::vector<torch::Tensor> norms, std::vector<torch::Tensor> k_pools,
                           std::vector<torch::Tensor> v_pools, torch::Tensor cos, torch::Tensor sin,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
                           int64_t vocab, double eps, bool int8, std::vector<int64_t> parts = {},
                           std::vector<int64_t> part_rows = {}, std::vector<torch::Tensor> biases = {},
                           std::vector<torch::Tensor> qk_norms = {}, std::vector<torch::Tensor> out_norms = {},
                           bool gelu = false, double embed_scale = 1.0, double attn_scale = 0.0,
                           std::vector<int64_t> sliding = {}, std::vector<torch::Tensor> local = {});

// kquant.cpp: the other block types of K-quant files (kinds 7-12: Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K;
// 13: Q5_0 in tiles of 16 rows, the int8 path's layout where AVX512-VNNI is built)
bool is_kq_kind(int64_t kind);
int64_t kq_stored_rows(int64_t kind, int64_t rows);  // rows the bytes hold (tiles: padded to 16)
int64_t kq_row_bytes(int64_t kind, int64_t cols);  // checks cols against the kind's block
void kq_matmul(const float* x, int64_t m, const uint8_t* w, int64_t kind, int64_t rows, int64_t cols, float* y,
               int64_t ldy, bool int8);
void kq_row_floats(const uint8_t* row, int64_t kind, int64_t cols, float* out);
void kq_row_floats_at(const uint8_t* w, int64_t kind, int64_t cols, int64_t n, float* out);  // row n, any kind

// quant.cpp and kquant.cpp: f(r0, MR) for the rows of x in groups of up to MAX, r0 the group's
// first row, MR its size as a compile-time constant (std::integral_constant), so each kernel is
// instantiated per group size.
template <int MR, int MAX, typename F>
inline void with_rows(int64_t size, int64_t r0, F& f) {
  if constexpr (MR < MAX) {
    if (size == MR) return f(r0, std::integral_constant<int, MR>{});
    return with_rows<MR + 1, MAX>(size, r0, f);
  } else {
    f(r0, std::integral_constant<int, MAX>{});
  }
}

template <int MAX, typename F>
inline void in_row_groups(int64_t m, F f) {
  for (int64_t r0 = 0; r0 < m; r0 += MAX) with_rows<1, MAX>(std::min<int64_t>(MAX, m - r0), r0, f);
}

// mask.cpp: a grammar's int32 bitmask (a bit a token, set where allowed) applied to rows of the
// logits in place: a clear bit's logit becomes -inf
void apply_token_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask);
