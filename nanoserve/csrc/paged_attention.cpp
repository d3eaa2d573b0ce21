// Decode attention read in place from the paged K/V pools (CPU).
//
// One query per row. Row b attends over the first context_lens[b] slots of its window,
// window[b, :]: the slot of each of its positions in the pools (slots, kv_heads, head_dim).
// The Python path (cache.py, _one_query_rows) gathers every row's window, padded to the
// widest, into a new tensor per layer and runs SDPA on the copy; this reads each key and
// value once where it lies, and nothing past a row's own length. The query heads that share
// a K/V head (grouped-query attention) are done together, so each K/V row is loaded once per
// group. Softmax in fp32 with the running maximum subtracted; bf16 pools are read as bf16 and
// widened per element. A row with context 0 (a padded row of a bucket) gets zeros.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                   const torch::Tensor& window, const torch::Tensor& context_lens,
                   torch::Tensor& out, double scale) {
  const int64_t rows = q.size(0), heads = q.size(1), hd = q.size(2);
  const int64_t kv_heads = k.size(1), group = heads / kv_heads;
  const int64_t width = window.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* wp = window.data_ptr<int64_t>();
  const int64_t* cp = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t k_row = k.stride(0), k_head = k.stride(1);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> qf(group * hd), acc(group * hd);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, g = item % kv_heads;
      const int64_t n = std::min<int64_t>(cp[b], width);
      T* o = op + (b * heads + g * group) * hd;
      if (n <= 0) {
        for (int64_t i = 0; i < group * hd; ++i) o[i] = static_cast<T>(0.0f);
        continue;
      }
      const T* qrow = qp + (b * heads + g * group) * hd;
      for (int64_t i = 0; i < group * hd; ++i) qf[i] = to_f(qrow[i]) * fscale;
      scores.assign(n * group, 0.0f);
      const int64_t* slots = wp + b * width;
      std::vector<float> mx(group, -std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < n; ++j) {
        const T* krow = kp + slots[j] * k_row + g * k_head;
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = qf.data() + h * hd;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < hd; ++d) s += qh[d] * to_f(krow[d]);
          scores[h * n + j] = s;
          if (s > mx[h]) mx[h] = s;
        }
      }
      std::vector<float> total(group, 0.0f);
      for (int64_t h = 0; h < group; ++h) {
        float* sh = scores.data() + h * n;
        for (int64_t j = 0; j < n; ++j) {
          sh[j] = std::exp(sh[j] - mx[h]);
          total[h] += sh[j];
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const T* vrow = vp + slots[j] * k_row + g * k_head;
        for (int64_t h = 0; h < group; ++h) {
          const float p = scores[h * n + j];
          float* ah = acc.data() + h * hd;
#pragma omp simd
          for (int64_t d = 0; d < hd; ++d) ah[d] += p * to_f(vrow[d]);
        }
      }
      for (int64_t h = 0; h < group; ++h)
        for (int64_t d = 0; d < hd; ++d) o[h * hd + d] = static_cast<T>(acc[h * hd + d] / total[h]);
    }
  });
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor window,
                               torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q (B, heads, hd), pools (slots, kv, hd)");
  TORCH_CHECK(k.strides() == v.strides() && k.stride(2) == 1, "K and V pools must share a contiguous layout");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of K/V heads");
  TORCH_CHECK(window.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "window and context_lens are int64");
  TORCH_CHECK(window.dim() == 2 && window.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              "one window row and one context length per query row");
  q = q.contiguous();
  window = window.contiguous();
  context_lens = context_lens.contiguous();
  {  // every slot a row reads must lie in the pools: a bad window is an error, never a stray read
    const int64_t* w = window.data_ptr<int64_t>();
    const int64_t* c = context_lens.data_ptr<int64_t>();
    const int64_t width = window.size(1), slots = k.size(0);
    for (int64_t b = 0; b < window.size(0); ++b) {
      const int64_t n = std::min<int64_t>(c[b], width);
      for (int64_t j = 0; j < n; ++j)
        TORCH_CHECK(w[b * width + j] >= 0 && w[b * width + j] < slots, "row ", b, " reads slot ",
                    w[b * width + j], ", outside the pools' ", slots, " slots");
    }
  }
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat) {
    decode_kernel<float>(q, k, v, window, context_lens, out, scale);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_kernel<at::BFloat16>(q, k, v, window, context_lens, out, scale);
  } else {
    TORCH_CHECK(false, "decode_attention takes float32 or bfloat16");
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention, read in place (CPU)");
}
