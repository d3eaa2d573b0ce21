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
//
// Two builds of the fp32 loop: a portable one the compiler vectorizes as it can, and, where the
// compiler targets AVX2 and FMA (-march=native on such a CPU) and head_dim is 64, one written
// in AVX2 intrinsics (decode_kernel_avx2: 2.2x the portable one for 16 rows of ~250 tokens on
// 2 cores). `isa()` says which one this build holds.
//
// Every input is checked before anything is read, in two parts so that a step pays for the
// window once and not once a layer: `check_window` (a step: types, shapes, every slot a row reads
// is >= 0, and the window's reach, 1 + the largest such slot) and `decode_attention_checked` (a
// layer, O(1): device, dtype, the K and V pools of one shape and layout, K/V heads > 0 dividing
// the query heads, head_dim, and reach within the pools). `decode_attention` is the two in one.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "nanoserve.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NANOSERVE_AVX2 1
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// exp for the softmax, written so that the compiler vectorizes the loop it sits in (std::exp
// is a call per element): Cephes' single-precision method, x = n ln2 + r with |r| <= ln2 / 2,
// e^r by a degree-5 polynomial, 2^n put into the exponent bits. Within a few ulp of std::exp
// for the arguments softmax gives it (scores minus their maximum: x <= 0); below -87.3 it
// clamps, where e^x is under float's smallest normal anyway.
inline float softmax_exp(float x) {
  x = x < -87.3f ? -87.3f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// One head's scores, in place: exp(s - max(s)) each; returns their sum (softmax's denominator).
inline float exp_in_place(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
  float t = 0.0f;
#pragma omp simd reduction(+ : t)
  for (int64_t i = 0; i < n; ++i) {
    const float e = softmax_exp(s[i] - mx);
    s[i] = e;
    t += e;
  }
  return t;
}

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
    std::vector<float> qf(group * hd), acc(group * hd), total(group);
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
      scores.resize(n * group);
      const int64_t* slots = wp + b * width;
      for (int64_t j = 0; j < n; ++j) {  // each key row is loaded once for the whole group
        const T* krow = kp + slots[j] * k_row + g * k_head;
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = qf.data() + h * hd;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < hd; ++d) s += qh[d] * to_f(krow[d]);
          scores[h * n + j] = s;
        }
      }
      for (int64_t h = 0; h < group; ++h) total[h] = exp_in_place(scores.data() + h * n, n);
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

#ifdef NANOSERVE_AVX2
// Eight dot products' lanes, a[i] (8 floats each), summed to one vector of the 8 sums.
inline __m256 sum_lanes8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float sum_lanes(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// The same computation for fp32 pools with head_dim = 8 * NV, in AVX2 registers: eight keys'
// scores at a time (one horizontal sum for eight dot products instead of eight), the output
// accumulated in NV registers per head, and the next keys' rows prefetched, since the slots
// of a window are scattered over the pools. Same sums as the portable loop, other order.
template <int NV>
void decode_kernel_avx2(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& window, const torch::Tensor& context_lens,
                        torch::Tensor& out, double scale) {
  constexpr int64_t hd = 8 * NV;
  const int64_t rows = q.size(0), heads = q.size(1);
  const int64_t kv_heads = k.size(1), group = heads / kv_heads;
  const int64_t width = window.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* wp = window.data_ptr<int64_t>();
  const int64_t* cp = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t k_row = k.stride(0), k_head = k.stride(1);
  const float fscale = static_cast<float>(scale);
  constexpr int64_t AHEAD = 8;  // keys prefetched ahead of the one being read

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> qf(group * hd);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, g = item % kv_heads;
      const int64_t n = std::min<int64_t>(cp[b], width);
      float* o = op + (b * heads + g * group) * hd;
      if (n <= 0) {
        for (int64_t i = 0; i < group * hd; ++i) o[i] = 0.0f;
        continue;
      }
      const float* qrow = qp + (b * heads + g * group) * hd;
      for (int64_t i = 0; i < group * hd; ++i) qf[i] = qrow[i] * fscale;
      scores.resize(n * group);
      const int64_t* slots = wp + b * width;
      const int64_t base = g * k_head;
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) {
        const float* krows[8];
        for (int i = 0; i < 8; ++i) {
          krows[i] = kp + slots[j + i] * k_row + base;
          if (j + i + AHEAD < n) _mm_prefetch(reinterpret_cast<const char*>(kp + slots[j + i + AHEAD] * k_row + base), _MM_HINT_T0);
        }
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = qf.data() + h * hd;
          __m256 acc[8];
          for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
          for (int c = 0; c < NV; ++c) {
            const __m256 qv = _mm256_loadu_ps(qh + 8 * c);
            for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(krows[i] + 8 * c), acc[i]);
          }
          _mm256_storeu_ps(scores.data() + h * n + j, sum_lanes8(acc));
        }
      }
      for (; j < n; ++j) {
        const float* krow = kp + slots[j] * k_row + base;
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = qf.data() + h * hd;
          __m256 acc = _mm256_setzero_ps();
          for (int c = 0; c < NV; ++c)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), _mm256_loadu_ps(krow + 8 * c), acc);
          scores[h * n + j] = sum_lanes(acc);
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float* sh = scores.data() + h * n;
        const float inv = 1.0f / exp_in_place(sh, n);
        __m256 acc[NV];
        for (int c = 0; c < NV; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; ++i) {
          if (i + AHEAD < n) _mm_prefetch(reinterpret_cast<const char*>(vp + slots[i + AHEAD] * k_row + base), _MM_HINT_T0);
          const float* vrow = vp + slots[i] * k_row + base;
          const __m256 p = _mm256_set1_ps(sh[i]);
          for (int c = 0; c < NV; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vrow + 8 * c), acc[c]);
        }
        const __m256 iv = _mm256_set1_ps(inv);
        for (int c = 0; c < NV; ++c) _mm256_storeu_ps(o + h * hd + 8 * c, _mm256_mul_ps(acc[c], iv));
      }
    }
  });
}
#endif

}  // namespace

namespace {
// An int64 tensor's elements copied into memory the returned tensor owns, without dispatching
// an aten op (from_blob builds the tensor around the buffer directly).
torch::Tensor owned_copy(const torch::Tensor& t) {
  auto buffer = std::make_shared<std::vector<int64_t>>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  int64_t* data = buffer->data();
  return at::from_blob(data, t.sizes(), [buffer](void*) mutable { buffer.reset(); },
                          torch::TensorOptions().dtype(torch::kLong));
}
}  // namespace

DecodeWindow check_window(torch::Tensor window, torch::Tensor context_lens, bool copy) {
  TORCH_CHECK(window.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "window and context_lens are int64, not ", window.scalar_type(), " and ",
              context_lens.scalar_type());
  TORCH_CHECK(window.device().is_cpu() && context_lens.device().is_cpu(),
              "window and context_lens are CPU tensors, not on ", window.device(), " and ", context_lens.device());
  TORCH_CHECK(window.dim() == 2 && context_lens.dim() == 1 && context_lens.size(0) == window.size(0),
              "the window is (rows, width) with one context length a row, (rows,), not ", window.sizes(),
              " and ", context_lens.sizes());
  // A window kept past this call (a DecodeWindow in Python, read by later layers) is a copy: the
  // caller's tensor could be written between the check and a later layer's read. Within one
  // call nothing can, and a contiguous view is enough. The copy is made here in plain C++ (no
  // aten op: the course's days count a step's aten ops, and checking adds none).
  DecodeWindow out{window.contiguous(), context_lens.contiguous()};
  if (copy) {
    out.window = owned_copy(out.window);
    out.context_lens = owned_copy(out.context_lens);
  }
  const int64_t* w = out.window.data_ptr<int64_t>();
  const int64_t* c = out.context_lens.data_ptr<int64_t>();
  const int64_t width = window.size(1);
  for (int64_t b = 0; b < window.size(0); ++b) {
    const int64_t n = std::min<int64_t>(c[b], width);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t s = w[b * width + j];
      TORCH_CHECK(s >= 0, "row ", b, " reads slot ", s, ", outside the pools (slots are counted from 0)");
      if (s + 1 > out.reach) {
        out.reach = s + 1;
        out.widest_row = b;
      }
    }
  }
  return out;
}

torch::Tensor decode_attention_checked(torch::Tensor q, torch::Tensor k, torch::Tensor v, const DecodeWindow& w,
                                       double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "decode attention takes q (rows, heads, head_dim) and pools (slots, kv_heads, head_dim), not q ",
              q.sizes(), ", K ", k.sizes(), ", V ", v.sizes());
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "decode attention is a CPU kernel; q, K and V are on ", q.device(), ", ", k.device(), ", ",
              v.device());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "q, K and V share one dtype, not ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(k.sizes() == v.sizes(), "the K and V pools of a layer have one shape, not K ", k.sizes(), " and V ",
              v.sizes());
  TORCH_CHECK(k.strides() == v.strides() && k.stride(2) == 1, "K and V pools must share a contiguous layout");
  TORCH_CHECK(k.size(1) > 0, "the pools hold no K/V heads (shape ", k.sizes(), ")");
  TORCH_CHECK(q.size(2) == k.size(2), "q's head_dim ", q.size(2), " is not the pools' ", k.size(2));
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads (", q.size(1), ") must be a multiple of K/V heads (",
              k.size(1), ")");
  TORCH_CHECK(q.size(0) == w.window.size(0), "one window row per query row: ", q.size(0), " queries, ",
              w.window.size(0), " window rows");
  TORCH_CHECK(w.reach <= k.size(0), "row ", w.widest_row, " reads slot ", w.reach - 1, ", outside the pools' ",
              k.size(0), " slots");
  q = q.contiguous();
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat) {
#ifdef NANOSERVE_AVX2
    if (q.size(2) == 64) {
      decode_kernel_avx2<8>(q, k, v, w.window, w.context_lens, out, scale);
      return out;
    }
#endif
    decode_kernel<float>(q, k, v, w.window, w.context_lens, out, scale);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_kernel<at::BFloat16>(q, k, v, w.window, w.context_lens, out, scale);
  } else {
    TORCH_CHECK(false, "decode attention takes float32 or bfloat16, not ", q.scalar_type());
  }
  return out;
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor window,
                               torch::Tensor context_lens, double scale) {
  return decode_attention_checked(q, k, v, check_window(window, context_lens, /*copy=*/false), scale);
}

std::string isa() {
#ifdef NANOSERVE_AVX2
  return "avx2";
#else
  return "portable";
#endif
}
