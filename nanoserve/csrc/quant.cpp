// Linears over weights as a GGUF file holds them, and one whole decode step in one call (CPU).
//
// A weight is a matrix of `out` rows by `in` columns in one of three kinds:
//   0  fp32 rows, (out, in) float
//   1  Q4_1: each row a run of blocks of 32 columns, 20 bytes a block: an fp16 scale d, an fp16
//      minimum m, then 16 bytes of 4-bit codes (byte j: column j in its low nibble, column j + 16
//      in its high one). Column value = d * code + m.
//   2  Q8_0: 34 bytes a block of 32: an fp16 scale d, then 32 signed bytes. Value = d * code.
// These are llama.cpp's block layouts, so a tensor read from the file is used as it lies. Kinds
//   3  Q4_1 and 4  Q8_0 hold the same bytes of each row in another order ("split": quant.py's
//      QuantTensor.split): the row's fp16 scales first (all G of them), then (Q4_1) its G minimums,
//      then the blocks' codes end to end. A row's scales are then converted to fp32 eight at a time
//      instead of one scalar conversion per block, the kernels' main cost besides the products.
//      The values, and the order of every sum, are those of kinds 1 and 2.
//
// The kernels widen each block to fp32 in registers, with d * code + m computed as one fused
// multiply-add: d has 11 significant bits and a code at most 8 (Q8_0) or 4 (Q4_1), so d * code
// is exact in fp32 and the one rounding of the add is numpy's dequantization's too. The weights the
// products see are therefore bit for bit the fp32 weights of the dequantized model; what differs
// from a matmul on those is only the order of the sums.
//
// `fused_decode` is a Llama decode step (one new token per row) written out: embedding, then per
// block RMSNorm, QKV, rotary, the K/V write into the paged pools, attention (decode_attention,
// paged_attention.cpp), the output projection, RMSNorm, gate/up, SiLU, down; the final norm and
// the head. One call from Python instead of ~2,000 torch operations a step.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "nanoserve.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NANOSERVE_QAVX2 1
#endif

#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t QK = 32;  // columns a block

inline bool is_q4(int64_t kind) { return kind == 1 || kind == 3; }
inline int64_t block_bytes(int64_t kind) { return kind == 0 ? QK * 4 : is_q4(kind) ? 20 : 34; }

inline float half_to_float(uint16_t h) {
#ifdef NANOSERVE_QAVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
    return sign ? -f : f;
  }
  uint32_t bits = exp == 31 ? sign | 0x7F800000u | (man << 13)  // inf, nan
                            : sign | ((exp + 112) << 23) | (man << 13);
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

struct Weight {
  const uint8_t* data;
  int64_t kind, rows, cols, row_bytes;
};

Weight weight_of(const torch::Tensor& w, int64_t kind, int64_t rows, int64_t cols) {
  TORCH_CHECK(kind >= 0 && kind <= 4, "weight kind is 0 (fp32), 1 (Q4_1), 2 (Q8_0), 3 or 4 (split), not ", kind);
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "weights are contiguous CPU tensors");
  if (kind == 0) {
    TORCH_CHECK(w.scalar_type() == torch::kFloat && w.dim() == 2 && w.size(0) == rows && w.size(1) == cols,
                "an fp32 weight is (", rows, ", ", cols, ") float32");
    return {reinterpret_cast<const uint8_t*>(w.data_ptr<float>()), kind, rows, cols, cols * 4};
  }
  TORCH_CHECK(cols % QK == 0, "a quantized weight's columns come in blocks of 32, not ", cols);
  const int64_t rb = cols / QK * block_bytes(kind);
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.numel() == rows * rb,
              "a quantized weight is ", rows, " rows of ", rb, " bytes (uint8)");
  return {w.data_ptr<uint8_t>(), kind, rows, cols, rb};
}

// Where block g of a quantized row keeps its scale, its minimum (Q4_1) and its codes, per kind.
struct BlockRef {
  const uint8_t* q;
  uint16_t d, m;
};

inline BlockRef block_ref(int64_t kind, int64_t groups, const uint8_t* row, int64_t g) {
  switch (kind) {
    case 1: return {row + g * 20 + 4, load_u16(row + g * 20), load_u16(row + g * 20 + 2)};
    case 2: return {row + g * 34 + 2, load_u16(row + g * 34), 0};
    case 3: return {row + 4 * groups + 16 * g, load_u16(row + 2 * g), load_u16(row + 2 * groups + 2 * g)};
    default: return {row + 2 * groups + 32 * g, load_u16(row + 2 * g), 0};
  }
}

// Block g of a row as 32 floats (the portable path, and the tails).
inline void block_to_floats(const Weight& w, const uint8_t* row, int64_t g, float* out) {
  if (w.kind == 0) {
    std::memcpy(out, row + g * QK * 4, QK * 4);
    return;
  }
  const BlockRef b = block_ref(w.kind, w.cols / QK, row, g);
  const float d = half_to_float(b.d);
  if (is_q4(w.kind)) {
    const float m = half_to_float(b.m);
    for (int j = 0; j < 16; ++j) {
      out[j] = std::fma(d, static_cast<float>(b.q[j] & 0x0F), m);
      out[j + 16] = std::fma(d, static_cast<float>(b.q[j] >> 4), m);
    }
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(b.q);
    for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(q[j]);
  }
}

// y[r * ldy + n] = x[r, :] . W[n, :] for rows r < m of x (m, cols) and outputs n in [n0, n1).
void rows_portable(const float* x, int64_t m, const Weight& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t groups = w.cols / QK, tail = w.cols % QK;  // a tail only for fp32
  float wf[QK];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.data + n * w.row_bytes;
    for (int64_t r = 0; r < m; ++r) y[r * ldy + n] = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      block_to_floats(w, row, g, wf);
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * w.cols + g * QK;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int j = 0; j < QK; ++j) s += wf[j] * xr[j];
        y[r * ldy + n] += s;
      }
    }
    if (tail) {
      const float* wr = reinterpret_cast<const float*>(row) + groups * QK;
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * w.cols + groups * QK;
        float s = 0.0f;
        for (int64_t j = 0; j < tail; ++j) s += wr[j] * xr[j];
        y[r * ldy + n] += s;
      }
    }
  }
}

#ifdef NANOSERVE_QAVX2
inline float hsum(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// A quantized block widened to four registers of 8 floats (columns 0-7, 8-15, 16-23, 24-31),
// from its scale d and (Q4_1) minimum m already broadcast, and its codes q.
template <bool Q4>
inline void widen(__m256 d, __m256 m, const uint8_t* q, __m256* wv) {
  if constexpr (Q4) {
    // Eight code bytes zero-extended to eight 32-bit lanes straight from memory: a lane's low
    // nibble is its column's code, and the lane shifted right by 4 is the code 16 columns on
    // (a byte's high nibble), so no mask is needed there and no byte shuffles at all.
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    wv[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)), m);  // columns 0-7
    wv[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask)), m);  // 8-15
    wv[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), m);    // 16-23
    wv[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), m);    // 24-31
  } else {
    for (int i = 0; i < 4; ++i)
      wv[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)))));
  }
}

// n halves from h to floats in out, eight at a time.
inline void halves_to_floats(const uint8_t* h, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 2 * i))));
  for (; i < n; ++i) out[i] = _cvtsh_ss(load_u16(h + 2 * i));
}

// MR rows of x against outputs [n0, n1): each block widened once and used for all MR rows.
// A accumulators a row keep enough independent FMA chains in flight when MR is small.
template <int KIND, int MR>
void rows_avx2(const float* x, const Weight& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int A = MR == 1 ? 4 : MR <= 4 ? 2 : 1;
  constexpr bool Q4 = KIND == 1 || KIND == 3, SPLIT = KIND >= 3;
  constexpr int64_t CHUNK = 64;  // blocks whose split scales are converted at once
  const int64_t groups = w.cols / QK, cols = w.cols;
  alignas(32) float ds[CHUNK], ms[CHUNK];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.data + n * w.row_bytes;
    __m256 acc[MR][A];
    for (int r = 0; r < MR; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += CHUNK) {
      const int64_t g1 = std::min(groups, g0 + CHUNK);
      if constexpr (SPLIT) {
        halves_to_floats(row + 2 * g0, g1 - g0, ds);
        if constexpr (Q4) halves_to_floats(row + 2 * groups + 2 * g0, g1 - g0, ms);
      }
      for (int64_t g = g0; g < g1; ++g) {
        __m256 wv[4];
        if constexpr (KIND == 0) {
          const float* p = reinterpret_cast<const float*>(row) + g * QK;
          for (int i = 0; i < 4; ++i) wv[i] = _mm256_loadu_ps(p + 8 * i);
        } else if constexpr (KIND == 1) {
          const uint8_t* p = row + g * 20;
          widen<true>(_mm256_set1_ps(_cvtsh_ss(load_u16(p))), _mm256_set1_ps(_cvtsh_ss(load_u16(p + 2))), p + 4, wv);
        } else if constexpr (KIND == 2) {
          const uint8_t* p = row + g * 34;
          widen<false>(_mm256_set1_ps(_cvtsh_ss(load_u16(p))), _mm256_setzero_ps(), p + 2, wv);
        } else if constexpr (KIND == 3) {
          widen<true>(_mm256_broadcast_ss(ds + g - g0), _mm256_broadcast_ss(ms + g - g0),
                      row + 4 * groups + 16 * g, wv);
        } else {
          widen<false>(_mm256_broadcast_ss(ds + g - g0), _mm256_setzero_ps(), row + 2 * groups + 32 * g, wv);
        }
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + r * cols + g * QK;
          for (int i = 0; i < 4; ++i) acc[r][i % A] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(xr + 8 * i), acc[r][i % A]);
        }
      }
    }
    for (int r = 0; r < MR; ++r) {
      __m256 s = acc[r][0];
      for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[r][a]);
      float t = hsum(s);
      if (KIND == 0) {  // fp32 rows need not be a multiple of 32 long
        const float* wr = reinterpret_cast<const float*>(row);
        const float* xr = x + r * cols;
        for (int64_t j = groups * QK; j < cols; ++j) t += wr[j] * xr[j];
      }
      y[r * ldy + n] = t;
    }
  }
}

template <int KIND>
void rows_avx2_any(const float* x, int64_t m, const Weight& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t r0 = 0; r0 < m; r0 += 8) {
    const float* xr = x + r0 * w.cols;
    float* yr = y + r0 * ldy;
    switch (std::min<int64_t>(8, m - r0)) {
      case 1: rows_avx2<KIND, 1>(xr, w, yr, ldy, n0, n1); break;
      case 2: rows_avx2<KIND, 2>(xr, w, yr, ldy, n0, n1); break;
      case 3: rows_avx2<KIND, 3>(xr, w, yr, ldy, n0, n1); break;
      case 4: rows_avx2<KIND, 4>(xr, w, yr, ldy, n0, n1); break;
      case 5: rows_avx2<KIND, 5>(xr, w, yr, ldy, n0, n1); break;
      case 6: rows_avx2<KIND, 6>(xr, w, yr, ldy, n0, n1); break;
      case 7: rows_avx2<KIND, 7>(xr, w, yr, ldy, n0, n1); break;
      default: rows_avx2<KIND, 8>(xr, w, yr, ldy, n0, n1); break;
    }
  }
}
#endif

// The int8 path (llama.cpp's): each row of x quantized once per block of 32 to int8 with a scale
// (xd = max|x| / 127), and its block sums kept; a block's dot product is then integer
// multiply-adds (maddubs: unsigned codes times signed activations, 32 at once), converted to
// float and scaled by d * xd, plus m * xd * sum(xq) for Q4_1's minimum.
struct XQ {
  std::vector<int8_t> q;    // (m, cols)
  std::vector<float> d, s;  // (m, groups): scale, scale * sum of codes
};

XQ quantize_rows(const float* x, int64_t m, int64_t cols) {
  const int64_t groups = cols / QK;
  XQ out{std::vector<int8_t>(m * cols), std::vector<float>(m * groups), std::vector<float>(m * groups)};
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xb = x + r * cols + g * QK;
      float amax = 0.0f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = out.q.data() + r * cols + g * QK;
      int sum = 0;
      for (int j = 0; j < QK; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
        sum += q[j];
      }
      out.d[r * groups + g] = d;
      out.s[r * groups + g] = d * static_cast<float>(sum);
    }
  return out;
}

// The int8 path without AVX2: the same integer sums, a block at a time.
void rows_q8_portable(const XQ& xq, int64_t m, const Weight& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t groups = w.cols / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.data + n * w.row_bytes;
    for (int64_t r = 0; r < m; ++r) {
      float t = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* xb = xq.q.data() + r * w.cols + g * QK;
        const int64_t i = r * groups + g;
        int32_t dot = 0;
        const BlockRef b = block_ref(w.kind, groups, row, g);
        if (is_q4(w.kind)) {
          for (int j = 0; j < 16; ++j) dot += (b.q[j] & 0x0F) * xb[j] + (b.q[j] >> 4) * xb[j + 16];
          t += half_to_float(b.d) * xq.d[i] * static_cast<float>(dot) + half_to_float(b.m) * xq.s[i];
        } else {
          const int8_t* q = reinterpret_cast<const int8_t*>(b.q);
          for (int j = 0; j < 32; ++j) dot += q[j] * xb[j];
          t += half_to_float(b.d) * xq.d[i] * static_cast<float>(dot);
        }
      }
      y[r * ldy + n] = t;
    }
  }
}

#ifdef NANOSERVE_QAVX2
template <int KIND, int MR>
void rows_q8(const XQ& xq, int64_t r0, const Weight& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  // A row's blocks are taken CHUNK at a time: first their scales d (and Q4_1's minimums m) as
  // floats (eight conversions at once from the split layout, one by one from the file's), each
  // block's d * xd for every row of x, and the minimums' term m * xd * sum(xq) summed in a
  // vector; then the integer products, one FMA a block and row. No scalar chain runs through
  // the blocks, which a per-block `sum += m * s` was (its add's latency every block).
  constexpr bool Q4 = KIND == 1 || KIND == 3, SPLIT = KIND >= 3;
  constexpr int64_t CHUNK = 64;
  constexpr int A = MR == 1 ? 4 : MR == 2 ? 2 : 1;  // independent FMA chains a row
  const int64_t groups = w.cols / QK, cols = w.cols;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i mask = _mm_set1_epi8(0x0F);
  alignas(32) float ds[CHUNK + 8], ms[CHUNK + 8], sc[MR][CHUNK];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.data + n * w.row_bytes;
    __m256 acc[MR][A], macc[MR];
    for (int r = 0; r < MR; ++r) {
      for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
      macc[r] = _mm256_setzero_ps();
    }
    float mtail[MR] = {};
    for (int64_t g0 = 0; g0 < groups; g0 += CHUNK) {
      const int64_t gn = std::min(CHUNK, groups - g0), g8 = gn / 8 * 8;
      if constexpr (SPLIT) {
        halves_to_floats(row + 2 * g0, gn, ds);
        if constexpr (Q4) halves_to_floats(row + 2 * groups + 2 * g0, gn, ms);
      } else {
        for (int64_t j = 0; j < gn; ++j) {
          const BlockRef b = block_ref(KIND, groups, row, g0 + j);
          ds[j] = _cvtsh_ss(b.d);
          if constexpr (Q4) ms[j] = _cvtsh_ss(b.m);
        }
      }
      for (int r = 0; r < MR; ++r) {
        const float* xd = xq.d.data() + (r0 + r) * groups + g0;
        const float* xs = xq.s.data() + (r0 + r) * groups + g0;
        int64_t j = 0;
        for (; j < g8; j += 8) {
          _mm256_store_ps(sc[r] + j, _mm256_mul_ps(_mm256_load_ps(ds + j), _mm256_loadu_ps(xd + j)));
          if constexpr (Q4) macc[r] = _mm256_fmadd_ps(_mm256_load_ps(ms + j), _mm256_loadu_ps(xs + j), macc[r]);
        }
        for (; j < gn; ++j) {
          sc[r][j] = ds[j] * xd[j];
          if constexpr (Q4) mtail[r] += ms[j] * xs[j];
        }
      }
      auto block = [&](int64_t j, auto slot) {
        constexpr int a = decltype(slot)::value;  // the accumulator: a compile-time index
        const int64_t g = g0 + j;
        __m256i codes;
        if constexpr (Q4) {
          const uint8_t* q = SPLIT ? row + 4 * groups + 16 * g : row + g * 20 + 4;
          const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
          codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), _mm_and_si128(qs, mask));
        } else {
          const uint8_t* q = SPLIT ? row + 2 * groups + 32 * g : row + g * 34 + 2;
          codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
        }
        const __m256i ucodes = Q4 ? codes : _mm256_sign_epi8(codes, codes);  // |q| for Q8_0
        for (int r = 0; r < MR; ++r) {
          __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + (r0 + r) * cols + g * QK));
          if constexpr (!Q4) xv = _mm256_sign_epi8(xv, codes);  // the sign moved onto x
          const __m256i pairs = _mm256_maddubs_epi16(ucodes, xv);      // 16 sums of two products
          const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
          acc[r][a] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc[r] + j), dots, acc[r][a]);
        }
      };
      int64_t j = 0;
      for (; j + A <= gn; j += A) {  // A blocks at a time, one accumulator each
        block(j, std::integral_constant<int, 0>{});
        if constexpr (A > 1) block(j + 1, std::integral_constant<int, (A > 1 ? 1 : 0)>{});
        if constexpr (A > 2) {
          block(j + 2, std::integral_constant<int, (A > 2 ? 2 : 0)>{});
          block(j + 3, std::integral_constant<int, (A > 2 ? 3 : 0)>{});
        }
      }
      for (; j < gn; ++j) block(j, std::integral_constant<int, 0>{});
    }
    for (int r = 0; r < MR; ++r) {
      __m256 t = acc[r][0];
      for (int a = 1; a < A; ++a) t = _mm256_add_ps(t, acc[r][a]);
      y[r * ldy + n] = hsum(t) + (hsum(macc[r]) + mtail[r]);
    }
  }
}

template <int KIND>
void rows_q8_any(const XQ& xq, int64_t m, const Weight& w, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t r0 = 0; r0 < m; r0 += 4) {
    float* yr = y + r0 * ldy;
    switch (std::min<int64_t>(4, m - r0)) {
      case 1: rows_q8<KIND, 1>(xq, r0, w, yr, ldy, n0, n1); break;
      case 2: rows_q8<KIND, 2>(xq, r0, w, yr, ldy, n0, n1); break;
      case 3: rows_q8<KIND, 3>(xq, r0, w, yr, ldy, n0, n1); break;
      default: rows_q8<KIND, 4>(xq, r0, w, yr, ldy, n0, n1); break;
    }
  }
}
#endif

// y (m, w.rows) = x (m, w.cols) @ W.T, the outputs split over the threads.
void matmul(const float* x, int64_t m, const Weight& w, float* y, bool int8) {
  const int64_t grain = 16;
  if (int8 && w.kind != 0) {
    const XQ xq = quantize_rows(x, m, w.cols);
    at::parallel_for(0, w.rows, grain, [&](int64_t n0, int64_t n1) {
#ifdef NANOSERVE_QAVX2
      switch (w.kind) {
        case 1: return rows_q8_any<1>(xq, m, w, y, w.rows, n0, n1);
        case 2: return rows_q8_any<2>(xq, m, w, y, w.rows, n0, n1);
        case 3: return rows_q8_any<3>(xq, m, w, y, w.rows, n0, n1);
        default: return rows_q8_any<4>(xq, m, w, y, w.rows, n0, n1);
      }
#else
      rows_q8_portable(xq, m, w, y, w.rows, n0, n1);
#endif
    });
    return;
  }
  at::parallel_for(0, w.rows, grain, [&](int64_t n0, int64_t n1) {
#ifdef NANOSERVE_QAVX2
    switch (w.kind) {
      case 0: return rows_avx2_any<0>(x, m, w, y, w.rows, n0, n1);
      case 1: return rows_avx2_any<1>(x, m, w, y, w.rows, n0, n1);
      case 2: return rows_avx2_any<2>(x, m, w, y, w.rows, n0, n1);
      case 3: return rows_avx2_any<3>(x, m, w, y, w.rows, n0, n1);
      default: return rows_avx2_any<4>(x, m, w, y, w.rows, n0, n1);
    }
#else
    rows_portable(x, m, w, y, w.rows, n0, n1);
#endif
  });
}

void rms_norm(const float* x, const float* weight, int64_t m, int64_t h, double eps, float* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * h;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < h; ++i) s += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(s / static_cast<float>(h) + static_cast<float>(eps));
    float* o = out + r * h;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) o[i] = xr[i] * inv * weight[i];
  }
}

}  // namespace

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor w, int64_t kind, int64_t out_features, bool int8) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
              "x is (rows, in) float32 on the CPU");
  x = x.contiguous();
  const Weight wt = weight_of(w, kind, out_features, x.size(1));
  auto y = torch::empty({x.size(0), out_features}, x.options());
  if (x.size(0)) matmul(x.data_ptr<float>(), x.size(0), wt, y.data_ptr<float>(), int8);
  return y;
}

torch::Tensor dequantize(torch::Tensor w, int64_t kind, int64_t out_features, int64_t in_features) {
  const Weight wt = weight_of(w, kind, out_features, in_features);
  auto y = torch::empty({out_features, in_features}, torch::dtype(torch::kFloat));
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out_features, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = wt.data + n * wt.row_bytes;
      if (kind == 0) {
        std::memcpy(yp + n * in_features, row, in_features * 4);
        continue;
      }
      for (int64_t g = 0; g < in_features / QK; ++g) block_to_floats(wt, row, g, yp + n * in_features + g * QK);
    }
  });
  return y;
}

torch::Tensor embed_rows(torch::Tensor ids, torch::Tensor w, int64_t kind, int64_t in_features) {
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1, "ids are (N,) int64");
  ids = ids.contiguous();
  const int64_t rows = kind == 0 ? w.size(0) : w.numel() / (in_features / QK * block_bytes(kind));
  const Weight wt = weight_of(w, kind, rows, in_features);
  auto y = torch::empty({ids.numel(), in_features}, torch::dtype(torch::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "token id ", ip[i], " is outside the vocabulary of ", rows);
    const uint8_t* row = wt.data + ip[i] * wt.row_bytes;
    if (kind == 0) {
      std::memcpy(yp + i * in_features, row, in_features * 4);
      continue;
    }
    for (int64_t g = 0; g < in_features / QK; ++g) block_to_floats(wt, row, g, yp + i * in_features + g * QK);
  }
  return y;
}

torch::Tensor fused_decode(torch::Tensor ids, torch::Tensor positions, torch::Tensor write_slots,
                           torch::Tensor window, torch::Tensor context_lens,
                           std::vector<torch::Tensor> mats, std::vector<int64_t> kinds,
                           std::vector<torch::Tensor> norms, std::vector<torch::Tensor> k_pools,
                           std::vector<torch::Tensor> v_pools, torch::Tensor cos, torch::Tensor sin,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
                           double eps, bool int8) {
  const int64_t layers = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(mats.size() == static_cast<size_t>(4 * layers + 2) && kinds.size() == mats.size(),
              "mats: the embedding, four matrices a block, the head; one kind each");
  TORCH_CHECK(norms.size() == static_cast<size_t>(2 * layers + 1) && v_pools.size() == k_pools.size(),
              "norms: two a block and the final one; one K and one V pool a block");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong &&
                  write_slots.scalar_type() == torch::kLong,
              "ids, positions and write_slots are int64");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim,
              "the rotary tables are contiguous float32 (positions, head_dim)");
  ids = ids.contiguous();
  positions = positions.contiguous();
  write_slots = write_slots.contiguous();
  const int64_t b = ids.numel(), hidden = norms[0].numel(), half = head_dim / 2;
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const int64_t qkv_size = q_size + 2 * kv_size, vocab_rows = mats.back().size(0);
  TORCH_CHECK(positions.numel() == b && write_slots.numel() == b, "one position and one slot a row");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = write_slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "position ", pos[r], " is past the rotary tables");
    TORCH_CHECK(slots[r] >= 0 && slots[r] < k_pools[0].size(0), "row ", r, " writes slot ", slots[r],
                ", outside the pools");
  }
  auto f32 = torch::dtype(torch::kFloat);
  torch::Tensor x = embed_rows(ids, mats[0], kinds[0], hidden);  // (B, H)
  auto h = torch::empty({b, hidden}, f32), tmp = torch::empty({b, hidden}, f32);
  auto qkv = torch::empty({b, qkv_size}, f32), q = torch::empty({b, heads, head_dim}, f32);
  auto gu = torch::empty({b, 2 * intermediate}, f32), act = torch::empty({b, intermediate}, f32);
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *tp = tmp.data_ptr<float>();
  float *qkvp = qkv.data_ptr<float>(), *qp = q.data_ptr<float>();
  float *gup = gu.data_ptr<float>(), *ap = act.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  auto weight = [&](int64_t i, int64_t rows, int64_t cols) { return weight_of(mats[i], kinds[i], rows, cols); };

  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor &kp = k_pools[l], &vp = v_pools[l];
    TORCH_CHECK(kp.scalar_type() == torch::kFloat && kp.is_contiguous() && vp.is_contiguous() &&
                    kp.size(1) == kv_heads && kp.size(2) == head_dim,
                "the K/V pools are contiguous float32 (slots, kv_heads, head_dim)");
    rms_norm(xp, norms[2 * l].data_ptr<float>(), b, hidden, eps, hp);
    matmul(hp, b, weight(1 + 4 * l, qkv_size, hidden), qkvp, int8);
    for (int64_t r = 0; r < b; ++r) {  // rotate q and k, store k and v, gather q
      float* row = qkvp + r * qkv_size;
      const float *c = cp + pos[r] * head_dim, *s = sp + pos[r] * head_dim;
      for (int64_t hh = 0; hh < heads + kv_heads; ++hh) {
        float* v = row + hh * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], e = v[i + half];
          v[i] = a * c[i] - e * s[i];
          v[i + half] = e * c[i + half] + a * s[i + half];
        }
      }
      std::memcpy(qp + r * q_size, row, q_size * 4);
      std::memcpy(kp.data_ptr<float>() + slots[r] * kv_size, row + q_size, kv_size * 4);
      std::memcpy(vp.data_ptr<float>() + slots[r] * kv_size, row + q_size + kv_size, kv_size * 4);
    }
    torch::Tensor attn = decode_attention(q, kp, vp, window, context_lens, scale);  // (B, heads, hd)
    matmul(attn.data_ptr<float>(), b, weight(2 + 4 * l, hidden, q_size), tp, int8);
    for (int64_t i = 0; i < b * hidden; ++i) xp[i] += tp[i];
    rms_norm(xp, norms[2 * l + 1].data_ptr<float>(), b, hidden, eps, hp);
    matmul(hp, b, weight(3 + 4 * l, 2 * intermediate, hidden), gup, int8);
    for (int64_t r = 0; r < b; ++r) {
      const float *g = gup + r * 2 * intermediate, *u = g + intermediate;
      float* a = ap + r * intermediate;
      for (int64_t i = 0; i < intermediate; ++i) a[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
    matmul(ap, b, weight(4 + 4 * l, hidden, intermediate), tp, int8);
    for (int64_t i = 0; i < b * hidden; ++i) xp[i] += tp[i];
  }
  rms_norm(xp, norms[2 * layers].data_ptr<float>(), b, hidden, eps, hp);
  auto logits = torch::empty({b, vocab_rows}, f32);
  matmul(hp, b, weight(4 * layers + 1, vocab_rows, hidden), logits.data_ptr<float>(), int8);
  return logits;
}
