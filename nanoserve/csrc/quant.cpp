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
//   5  Q4_1 and 6  Q8_0 in "tiles" (QuantTensor.tiles): rows taken 16 at a time (a tile; the
//      last padded with zero rows), and a tile's blocks stored one after another, block g of its
//      16 rows together: their 16 fp16 scales, then 16 fp16 minimums (Q4_1) or 16 int16 sums of
//      the block's codes (Q8_0), then the codes four bytes at a time: bytes 4c..4c+3 of row 0,
//      of row 1, ..., of row 15, for c = 0..3 (Q4_1) or 0..7 (Q8_0). Sixteen rows' four bytes are
//      one 64-byte vector whose 32-bit lane n is row n, so one AVX-512 VNNI instruction (vpdpbusd)
//      multiplies four columns of 16 rows by the same four int8 activations and adds each row's
//      four products into its lane: the int8 path's kernel where the CPU has AVX512-VNNI.
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
// the head. One call from Python instead of ~2,000 torch operations a step. It checks all its
// inputs before it writes anything: every norm's length, every layer's K/V pools (shape, dtype,
// device) and the write and read slots against the smallest of them, every matrix's size, and the
// window once (check_window, paged_attention.cpp), which the layers then share. A Gemma 3 step
// (phase 6) is the same walk with its switches: the embedding scaled, a norm after attention and
// after the MLP (out_norms), GELU for SiLU, its own query scale, and its sliding blocks writing and
// reading their own slots and window with their own rotary tables (`local`), which Python cuts
// and maps once a step as the ops path does (cache.py's `_latest` and `local_of`).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "nanoserve.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NANOSERVE_QAVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define NANOSERVE_QVNNI512 1  // the tiles kernel (kinds 5, 6)
#endif
#endif

#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t QK = 32;  // columns a block

constexpr int64_t TILE = 16;  // rows a tile (kinds 5 and 6)

inline bool is_q4(int64_t kind) { return kind == 1 || kind == 3 || kind == 5; }
inline bool is_tiles(int64_t kind) { return kind >= 5; }
inline int64_t tile_count(int64_t rows) { return (rows + TILE - 1) / TILE; }

// bytes a block of one row takes (tiles: 2 more for Q8_0's code sums)
inline int64_t block_bytes(int64_t kind) {
  return kind == 0 ? QK * 4 : is_q4(kind) ? 20 : kind == 6 ? 36 : 34;
}

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
  int64_t kind, rows, cols, row_bytes;  // tiles: a tile is 16 * row_bytes
};

Weight weight_of(const torch::Tensor& w, int64_t kind, int64_t rows, int64_t cols) {
  TORCH_CHECK(kind >= 0 && kind <= 13,
              "weight kind is 0 (fp32), 1 (Q4_1), 2 (Q8_0), 3 or 4 (split), 5 or 6 (tiles), 7-12 (Q4_0, Q5_0, "
              "Q5_1, Q4_K, Q5_K, Q6_K: kquant.cpp), 13 (Q5_0 tiles), not ", kind);
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "weights are contiguous CPU tensors");
  if (is_kq_kind(kind)) {
    const int64_t rb = kq_row_bytes(kind, cols);
    const int64_t stored = kq_stored_rows(kind, rows);
    TORCH_CHECK(w.scalar_type() == torch::kByte && w.numel() == stored * rb,
                "a quantized weight is ", stored, " rows of ", rb, " bytes (uint8)");
    return {w.data_ptr<uint8_t>(), kind, rows, cols, rb};
  }
  if (kind == 0) {
    TORCH_CHECK(w.scalar_type() == torch::kFloat && w.dim() == 2 && w.size(0) == rows && w.size(1) == cols,
                "an fp32 weight is (", rows, ", ", cols, ") float32");
    return {reinterpret_cast<const uint8_t*>(w.data_ptr<float>()), kind, rows, cols, cols * 4};
  }
  TORCH_CHECK(cols % QK == 0, "a quantized weight's columns come in blocks of 32, not ", cols);
  const int64_t rb = cols / QK * block_bytes(kind);
  const int64_t stored = is_tiles(kind) ? tile_count(rows) * TILE : rows;
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.numel() == stored * rb,
              "a quantized weight is ", stored, " rows of ", rb, " bytes (uint8)");
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

// Block g of row n of a tiles weight, its codes gathered into scratch (32 bytes) in the file's order.
inline BlockRef tile_block_ref(const Weight& w, int64_t n, int64_t g, uint8_t* scratch) {
  const int64_t lane = n % TILE;
  const uint8_t* p = w.data + (n / TILE) * TILE * w.row_bytes + g * TILE * block_bytes(w.kind);
  const int quads = is_q4(w.kind) ? 4 : 8;
  for (int c = 0; c < quads; ++c) std::memcpy(scratch + 4 * c, p + 64 + 64 * c + 4 * lane, 4);
  return {scratch, load_u16(p + 2 * lane), static_cast<uint16_t>(is_q4(w.kind) ? load_u16(p + 32 + 2 * lane) : 0)};
}

// Block g of row n, whatever the kind's layout.
inline BlockRef any_block_ref(const Weight& w, int64_t n, int64_t g, uint8_t* scratch) {
  if (is_tiles(w.kind)) return tile_block_ref(w, n, g, scratch);
  return block_ref(w.kind, w.cols / QK, w.data + n * w.row_bytes, g);
}

// Block g of a row as 32 floats (the portable path, and the tails).
inline void block_to_floats(const Weight& w, int64_t n, int64_t g, float* out) {
  if (w.kind == 0) {
    std::memcpy(out, w.data + n * w.row_bytes + g * QK * 4, QK * 4);
    return;
  }
  uint8_t scratch[QK];
  const BlockRef b = any_block_ref(w, n, g, scratch);
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
      block_to_floats(w, n, g, wf);
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
  in_row_groups<8>(m, [&](int64_t r0, auto mr) {
    rows_avx2<KIND, decltype(mr)::value>(x + r0 * w.cols, w, y + r0 * ldy, ldy, n0, n1);
  });
}
#endif

// The int8 path (llama.cpp's): each row of x quantized once per block of 32 to int8 with a scale
// (xd = max|x| / 127), and its block sums kept; a block's dot product is then integer
// multiply-adds (maddubs: unsigned codes times signed activations, 32 at once), converted to
// float and scaled by d * xd, plus m * xd * sum(xq) for Q4_1's minimum.
struct XQ {
  std::vector<int8_t> q;    // (m, cols)
  std::vector<float> d, s;  // (m, groups): scale, scale * sum of codes
  std::vector<uint8_t> u;   // (m, cols) q + 128, unsigned: the tiles kernel's operand against Q8_0
};

XQ quantize_rows(const float* x, int64_t m, int64_t cols, bool offset = false) {
  const int64_t groups = cols / QK;
  XQ out{std::vector<int8_t>(m * cols), std::vector<float>(m * groups), std::vector<float>(m * groups), {}};
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xb = x + r * cols + g * QK;
#ifdef NANOSERVE_QAVX2
      {  // the same numbers eight lanes at a time: max|x|, x * (1 / d) rounded to nearest even
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i] = _mm256_loadu_ps(xb + 8 * i)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m256 iv = _mm256_set1_ps(id);
        __m256i n[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
          n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
          total = _mm256_add_epi32(total, n[i]);
        }
        // int32 -> int8 with packs (in-lane), then the lanes put back in column order
        const __m256i w16a = _mm256_packs_epi32(n[0], n[1]), w16b = _mm256_packs_epi32(n[2], n[3]);
        const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b),
                                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + r * cols + g * QK), b8);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        out.d[r * groups + g] = d;
        out.s[r * groups + g] = d * static_cast<float>(_mm_cvtsi128_si32(t));
        continue;
      }
#endif
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
  if (offset) {
    out.u.resize(m * cols);
    for (int64_t i = 0; i < m * cols; ++i) out.u[i] = static_cast<uint8_t>(out.q[i] ^ 0x80);
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
        uint8_t scratch[QK];
        const BlockRef b = any_block_ref(w, n, g, scratch);
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
  // Four FMA chains a row, whatever MR (a chunk's blocks in turn, its last few past a multiple of
  // four on the first chain; the four summed in one order at the end), so a row's sum is taken in
  // the same order however many rows share the call, and its result is bit for bit the same
  // alone, in a decode batch of any size or among a speculative step's draft rows (batch
  // invariance, which int8 needs more than fp32 does: a last-bit change can move an activation's
  // rounding by a whole step). One row is computed as it was before; rows in groups once kept 2
  // or 1 chains, which differed from it. The price, on an AVX2 build (16 vector registers; four
  // rows of four chains spill): a 64-row product of SmolLM2's matrices takes ~20% longer (the
  // gate/up 1.51 ms against 1.30), one row the same.
  constexpr int A = 4;
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
        constexpr int a = decltype(slot)::value;  // the chain: a compile-time index
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
      for (; j + A <= gn; j += A) {
        block(j, std::integral_constant<int, 0>{});
        block(j + 1, std::integral_constant<int, 1>{});
        block(j + 2, std::integral_constant<int, 2>{});
        block(j + 3, std::integral_constant<int, 3>{});
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
  in_row_groups<4>(m, [&](int64_t r0, auto mr) {
    rows_q8<KIND, decltype(mr)::value>(xq, r0, w, y + r0 * ldy, ldy, n0, n1);
  });
}
#endif

#ifdef NANOSERVE_QVNNI512
// The int8 path over tiles (kinds 5, 6): 16 output rows at once, MR rows of x. For block g of a
// tile, four columns of all 16 rows are one 64-byte vector (lane n: row n's four codes); vpdpbusd
// multiplies them by four activations broadcast to every lane and adds each lane's four products
// to its int32 sum. A block's 32 columns are 8 such instructions (Q4_1: 4 vectors of bytes, their
// low nibbles columns 0-15 and high nibbles 16-31), summed in two chains; the exact integer dot is
// then scaled by d * xd per row and added into 16 float sums; Q4_1's minimums add m * xd * sum(xq)
// in another 16. The integer sums are the split kernel's exactly; only the float additions run in
// another order. Q8_0's codes are signed, and vpdpbusd takes one unsigned operand: x goes in as
// xq + 128 and each row's 128 * sum(codes), stored with the tile, comes off.
template <bool Q4, int MR>
void tiles_q8(const XQ& xq, int64_t r0, const Weight& w, float* y, int64_t ldy, int64_t t0, int64_t t1) {
  const int64_t groups = w.cols / QK, cols = w.cols, tb = TILE * block_bytes(w.kind);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w.data + t * TILE * w.row_bytes;
    __m512 acc[MR], macc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = macc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = tile + g * tb;
      // The weights stream from memory once a token: asking for the lines 4 KB ahead (about 13
      // Q4_1 blocks of the tile) measured 20% faster than the hardware prefetcher alone here.
      for (int64_t o = 0; o < tb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + 4096 + o), _MM_HINT_T0);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      if constexpr (Q4) {
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(p + 64 + 64 * c);
          lo[c] = _mm512_and_si512(v, mask);
          hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        }
        for (int r = 0; r < MR; ++r) {
          const int8_t* xb = xq.q.data() + (r0 + r) * cols + g * QK;
          __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
          for (int c = 0; c < 4; ++c) {
            int32_t a, b;
            std::memcpy(&a, xb + 4 * c, 4);
            std::memcpy(&b, xb + 16 + 4 * c, 4);
            s0 = _mm512_dpbusd_epi32(s0, lo[c], _mm512_set1_epi32(a));
            s1 = _mm512_dpbusd_epi32(s1, hi[c], _mm512_set1_epi32(b));
          }
          const int64_t i = (r0 + r) * groups + g;
          const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xq.d[i])), dots, acc[r]);
          macc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xq.s[i]), macc[r]);
        }
      } else {
        const __m512i comp = _mm512_slli_epi32(
            _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))), 7);
        __m512i cv[8];
        for (int c = 0; c < 8; ++c) cv[c] = _mm512_loadu_si512(p + 64 + 64 * c);
        for (int r = 0; r < MR; ++r) {
          const uint8_t* xb = xq.u.data() + (r0 + r) * cols + g * QK;
          __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
          for (int c = 0; c < 8; c += 2) {
            int32_t a, b;
            std::memcpy(&a, xb + 4 * c, 4);
            std::memcpy(&b, xb + 4 * c + 4, 4);
            s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(a), cv[c]);
            s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(b), cv[c + 1]);
          }
          const int64_t i = (r0 + r) * groups + g;
          const __m512 dots = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(s0, s1), comp));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xq.d[i])), dots, acc[r]);
        }
      }
    }
    const int64_t n0 = t * TILE, live = std::min<int64_t>(TILE, w.rows - n0);
    const __mmask16 keep = static_cast<__mmask16>((1u << live) - 1);
    for (int r = 0; r < MR; ++r)
      _mm512_mask_storeu_ps(y + r * ldy + n0, keep, Q4 ? _mm512_add_ps(acc[r], macc[r]) : acc[r]);
  }
}

template <bool Q4>
void tiles_q8_any(const XQ& xq, int64_t m, const Weight& w, float* y, int64_t ldy, int64_t t0, int64_t t1) {
  in_row_groups<4>(m, [&](int64_t r0, auto mr) {
    tiles_q8<Q4, decltype(mr)::value>(xq, r0, w, y + r0 * ldy, ldy, t0, t1);
  });
}
#endif

// y (m, w.rows) = x (m, w.cols) @ W.T, the outputs split over the threads.
// `next`, when given, is the matrix the caller multiplies by after this one: each thread ends by
// asking for the first 4 KB of the part of it the same thread will read, so that its stream does
// not start cold (the kernel prefetches 4 KB ahead of itself once it runs).
void matmul(const float* x, int64_t m, const Weight& w, float* y, bool int8, const Weight* next = nullptr,
            int64_t ldy = -1) {
  const int64_t grain = 16;
  if (is_kq_kind(w.kind)) return kq_matmul(x, m, w.data, w.kind, w.rows, w.cols, y, ldy < 0 ? w.rows : ldy, int8);
  if (ldy >= 0 && ldy != w.rows) {  // a part of a stack: its own (m, rows) product, then copied
    std::vector<float> part(m * w.rows);
    matmul(x, m, w, part.data(), int8, next);
    for (int64_t r = 0; r < m; ++r) std::memcpy(y + r * ldy, part.data() + r * w.rows, w.rows * 4);
    return;
  }
#ifdef NANOSERVE_QVNNI512
  if (int8 && is_tiles(w.kind)) {
    const XQ xq = quantize_rows(x, m, w.cols, w.kind == 6);
    const int64_t tiles = tile_count(w.rows);
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      if (w.kind == 5)
        tiles_q8_any<true>(xq, m, w, y, w.rows, t0, t1);
      else
        tiles_q8_any<false>(xq, m, w, y, w.rows, t0, t1);
      if (next != nullptr && is_tiles(next->kind)) {
        const uint8_t* p = next->data + (t0 * tile_count(next->rows) / tiles) * TILE * next->row_bytes;
        for (int64_t o = 0; o < 4096; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
      }
    });
    return;
  }
#endif
  if (is_tiles(w.kind)) {  // fp32 activations over tiles, or no AVX512-VNNI: the portable loops
    const XQ xq = int8 ? quantize_rows(x, m, w.cols) : XQ{};
    at::parallel_for(0, w.rows, grain, [&](int64_t n0, int64_t n1) {
      if (int8) return rows_q8_portable(xq, m, w, y, w.rows, n0, n1);
      rows_portable(x, m, w, y, w.rows, n0, n1);
    });
    return;
  }
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

// A matrix stacked by rows from parts of different kinds (a Q4_K_M file's Q, K in Q5_0 and V in
// Q8_0): its product is each part's, side by side in y's rows.
struct Stack {
  std::vector<Weight> parts;
};

void matmul_stack(const float* x, int64_t m, const Stack& s, float* y, bool int8, const Stack* next) {
  const Weight* after = next != nullptr ? &next->parts[0] : nullptr;
  if (s.parts.size() == 1) return matmul(x, m, s.parts[0], y, int8, after);
  int64_t total = 0, at = 0;
  for (const Weight& p : s.parts) total += p.rows;
  for (size_t i = 0; i < s.parts.size(); ++i) {
    matmul(x, m, s.parts[i], y + at, int8, i + 1 < s.parts.size() ? &s.parts[i + 1] : after, total);
    at += s.parts[i].rows;
  }
}

// exp(x) as softmax's (paged_attention.cpp's softmax_exp: Cephes' method, within a few ulp of
// std::exp), 16 lanes at once; x clamped to [-87.3, 88.3], past which float's exp under- or
// overflows. Built for AVX-512 CPUs only: on AVX2 builds SiLU keeps std::exp, so their fused
// step computes what it computed before (day 61's outputs were made on one).
#ifdef NANOSERVE_QVNNI512
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

// a = silu(g) * u = g / (1 + exp(-g)) * u over n values (std::exp is a call per value: ~0.1 ms
// of a SmolLM2 step, 46,080 of them).
inline void silu_mul(const float* g, const float* u, float* a, int64_t n) {
  int64_t i = 0;
#ifdef NANOSERVE_QVNNI512
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = exp16(_mm512_sub_ps(zero, gv));
    _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) a[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// a = gelu_tanh(g) * u over n values. GELU's tanh approximation, 0.5 g (1 + tanh(y)) with
// y = sqrt(2 / pi) (g + 0.044715 g^3), is g / (1 + exp(-2y)): the same identity as SiLU's, so the
// same exp (Gemma's MLP; torch's F.gelu(approximate="tanh") to within a few ulp).
inline void gelu_mul(const float* g, const float* u, float* a, int64_t n) {
  constexpr float k = 1.5957691216057308f;  // 2 sqrt(2 / pi)
  int64_t i = 0;
#ifdef NANOSERVE_QVNNI512
  const __m512 one = _mm512_set1_ps(1.0f), nk = _mm512_set1_ps(-k), c = _mm512_set1_ps(0.044715f);
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(c, gv), _mm512_mul_ps(gv, gv), gv);  // g + c g^3
    const __m512 e = exp16(_mm512_mul_ps(nk, inner));
    _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) {
    const float inner = g[i] + 0.044715f * g[i] * g[i] * g[i];
    a[i] = g[i] / (1.0f + std::exp(-k * inner)) * u[i];
  }
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

bool has_tiles() {
#ifdef NANOSERVE_QVNNI512
  return true;
#else
  return false;
#endif
}

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
      if (is_kq_kind(kind)) {
        kq_row_floats_at(wt.data, kind, in_features, n, yp + n * in_features);
        continue;
      }
      for (int64_t g = 0; g < in_features / QK; ++g) block_to_floats(wt, n, g, yp + n * in_features + g * QK);
    }
  });
  return y;
}

torch::Tensor embed_rows(torch::Tensor ids, torch::Tensor w, int64_t kind, int64_t in_features, int64_t rows) {
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1 && ids.device().is_cpu(),
              "ids are (N,) int64 on the CPU");
  TORCH_CHECK(kind >= 0 && kind <= 13,
              "weight kind is 0 (fp32), 1 (Q4_1), 2 (Q8_0), 3 or 4 (split), 5 or 6 (tiles), 7-12 (Q4_0, Q5_0, "
              "Q5_1, Q4_K, Q5_K, Q6_K), 13 (Q5_0 tiles), not ", kind);
  TORCH_CHECK(in_features > 0, "an embedding row has at least one column, not ", in_features);
  TORCH_CHECK(kind == 0 || is_kq_kind(kind) || in_features % QK == 0,
              "a quantized weight's columns come in blocks of 32, not ", in_features);
  if (rows < 0) {  // the rows the bytes hold (tiles: padding included)
    const int64_t row_bytes = kind == 0          ? in_features * 4
                              : is_kq_kind(kind) ? kq_row_bytes(kind, in_features)
                                                 : in_features / QK * block_bytes(kind);
    TORCH_CHECK(w.numel() * w.element_size() % row_bytes == 0, "the weight's ", w.numel() * w.element_size(),
                " bytes are not whole rows of ", in_features, " columns");
    rows = w.numel() * w.element_size() / row_bytes;
  }
  const Weight wt = weight_of(w, kind, rows, in_features);
  ids = ids.contiguous();
  auto y = torch::empty({ids.numel(), in_features}, torch::dtype(torch::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "token id ", ip[i], " is outside the vocabulary of ", rows);
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    if (kind == 0) {
      std::memcpy(yp + i * in_features, wt.data + ip[i] * wt.row_bytes, in_features * 4);
      continue;
    }
    if (is_kq_kind(kind)) {
      kq_row_floats_at(wt.data, kind, in_features, ip[i], yp + i * in_features);
      continue;
    }
    for (int64_t g = 0; g < in_features / QK; ++g) block_to_floats(wt, ip[i], g, yp + i * in_features + g * QK);
  }
  return y;
}

torch::Tensor fused_decode(torch::Tensor ids, torch::Tensor positions, torch::Tensor write_slots,
                           torch::Tensor window, torch::Tensor context_lens,
                           std::vector<torch::Tensor> mats, std::vector<int64_t> kinds,
                           std::vector<torch::Tensor> norms, std::vector<torch::Tensor> k_pools,
                           std::vector<torch::Tensor> v_pools, torch::Tensor cos, torch::Tensor sin,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
                           int64_t vocab, double eps, bool int8, std::vector<int64_t> parts,
                           std::vector<int64_t> part_rows, std::vector<torch::Tensor> biases,
                           std::vector<torch::Tensor> qk_norms, std::vector<torch::Tensor> out_norms, bool gelu,
                           double embed_scale, double attn_scale, std::vector<int64_t> sliding,
                           std::vector<torch::Tensor> local) {
  // Everything is checked here, before the first K/V write: an error leaves the pools as they were.
  const int64_t layers = static_cast<int64_t>(k_pools.size()), slots_n = 4 * layers + 2;
  if (parts.empty()) parts.assign(slots_n, 1);
  TORCH_CHECK(static_cast<int64_t>(parts.size()) == slots_n,
              "parts: how many of mats each of the ", slots_n, " matrices takes, not ", parts.size(), " counts");
  int64_t tensors = 0;
  for (int64_t i = 0; i < slots_n; ++i) {
    TORCH_CHECK(parts[i] >= 1 && (parts[i] == 1 || i > 0), "matrix ", i, " takes ", parts[i],
                " tensors; each takes at least one, and the embedding exactly one");
    tensors += parts[i];
  }
  TORCH_CHECK(mats.size() == static_cast<size_t>(tensors) && kinds.size() == mats.size(),
              "mats: the embedding, four matrices a block, the head (a stacked one as its parts); one kind each");
  TORCH_CHECK(part_rows.empty() || part_rows.size() == mats.size(), "part_rows: one row count a tensor of mats");
  TORCH_CHECK(tensors == slots_n || !part_rows.empty(), "stacked matrices need part_rows");
  TORCH_CHECK(biases.empty() || static_cast<int64_t>(biases.size()) == layers,
              "biases: none, or one QKV bias a block");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers,
              "qk_norms: none, or a query and a key norm a block");
  TORCH_CHECK(out_norms.empty() || static_cast<int64_t>(out_norms.size()) == 2 * layers,
              "out_norms: none, or a norm after attention and one after the MLP a block");
  TORCH_CHECK(sliding.empty() || static_cast<int64_t>(sliding.size()) == layers,
              "sliding: none, or one flag a block (1: the block reads the local window)");
  auto is_sliding = [&](int64_t l) { return !sliding.empty() && sliding[l] != 0; };
  bool any_sliding = false;
  for (int64_t l = 0; l < static_cast<int64_t>(sliding.size()); ++l) any_sliding = any_sliding || is_sliding(l);
  TORCH_CHECK(local.empty() || local.size() == 5,
              "local: none, or the sliding blocks' write slots, window, context lengths, cos and sin");
  TORCH_CHECK(!any_sliding || !local.empty(),
              "sliding blocks need local: their write slots, window, context lengths and rotary tables");
  TORCH_CHECK(std::isfinite(embed_scale) && embed_scale > 0, "embed_scale is a positive number, not ", embed_scale);
  TORCH_CHECK(std::isfinite(attn_scale) && attn_scale >= 0,
              "attn_scale is positive (or 0: head_dim ** -0.5), not ", attn_scale);
  TORCH_CHECK(norms.size() == static_cast<size_t>(2 * layers + 1) && v_pools.size() == k_pools.size(),
              "norms: two a block and the final one; one K and one V pool a block");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads (", heads,
              ") must be a positive multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "head_dim is positive and even (rotary halves), not ", head_dim);
  TORCH_CHECK(intermediate > 0 && vocab > 0, "intermediate (", intermediate, ") and vocab (", vocab,
              ") are positive");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong &&
                  write_slots.scalar_type() == torch::kLong,
              "ids, positions and write_slots are int64");
  TORCH_CHECK(ids.device().is_cpu() && positions.device().is_cpu() && write_slots.device().is_cpu(),
              "ids, positions and write_slots are CPU tensors");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.device().is_cpu() &&
                  sin.device().is_cpu() && cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.size(1) == head_dim,
              "the rotary tables are contiguous float32 (positions, head_dim = ", head_dim, ") on the CPU, not ",
              cos.sizes(), " and ", sin.sizes());
  const int64_t hidden = norms[0].numel();
  TORCH_CHECK(hidden > 0, "the norms are empty");
  for (size_t i = 0; i < norms.size(); ++i)
    TORCH_CHECK(norms[i].scalar_type() == torch::kFloat && norms[i].is_contiguous() &&
                    norms[i].device().is_cpu() && norms[i].numel() == hidden,
                "norm ", i, " is ", norms[i].numel(), " ", norms[i].scalar_type(), " on ", norms[i].device(),
                "; every norm is ", hidden, " contiguous float32 on the CPU");
  for (size_t i = 0; i < out_norms.size(); ++i)
    TORCH_CHECK(out_norms[i].scalar_type() == torch::kFloat && out_norms[i].is_contiguous() &&
                    out_norms[i].device().is_cpu() && out_norms[i].numel() == hidden,
                "out norm ", i, " is ", out_norms[i].numel(), " ", out_norms[i].scalar_type(), " on ",
                out_norms[i].device(), "; every norm is ", hidden, " contiguous float32 on the CPU");
  ids = ids.contiguous();
  positions = positions.contiguous();
  write_slots = write_slots.contiguous();
  const int64_t b = ids.numel(), half = head_dim / 2;
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const int64_t qkv_size = q_size + 2 * kv_size, vocab_rows = vocab;
  TORCH_CHECK(positions.numel() == b && write_slots.numel() == b, "one position and one slot a row");
  const DecodeWindow checked = check_window(window, context_lens, /*copy=*/false);  // read within this call
  TORCH_CHECK(checked.window.size(0) == b, "one window row a row: ", b, " rows, ", checked.window.size(0),
              " window rows");
  // The sliding blocks' own slots, window and rotary tables (Gemma 3's local layers): checked as
  // the full blocks' are.
  const int64_t* local_slots = nullptr;
  const float *local_cp = nullptr, *local_sp = nullptr;
  DecodeWindow local_checked;
  if (!local.empty()) {
    TORCH_CHECK(local[0].scalar_type() == torch::kLong && local[0].device().is_cpu() && local[0].is_contiguous() &&
                    local[0].numel() == b,
                "the sliding blocks' write slots are ", b, " contiguous int64 on the CPU, one a row");
    local_checked = check_window(local[1], local[2], /*copy=*/false);
    TORCH_CHECK(local_checked.window.size(0) == b, "one sliding window row a row: ", b, " rows, ",
                local_checked.window.size(0), " window rows");
    for (int64_t t = 3; t < 5; ++t)
      TORCH_CHECK(local[t].scalar_type() == torch::kFloat && local[t].device().is_cpu() && local[t].is_contiguous() &&
                      local[t].dim() == 2 && local[t].sizes() == cos.sizes(),
                  "the sliding blocks' rotary tables are contiguous float32 ", cos.sizes(), " on the CPU, not ",
                  local[t].sizes());
    local_slots = local[0].data_ptr<int64_t>();
    local_cp = local[3].data_ptr<float>();
    local_sp = local[4].data_ptr<float>();
  }
  // The pools: every layer's, each K and V of one shape; in each group (full, sliding) the fewest
  // slots bound every write and read.
  int64_t fewest[2] = {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max()};
  int64_t fewest_layer[2] = {-1, -1};
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor &kp = k_pools[l], &vp = v_pools[l];
    TORCH_CHECK(kp.scalar_type() == torch::kFloat && vp.scalar_type() == torch::kFloat && kp.is_contiguous() &&
                    vp.is_contiguous() && kp.device().is_cpu() && vp.device().is_cpu() && kp.dim() == 3 &&
                    kp.sizes() == vp.sizes() && kp.size(1) == kv_heads && kp.size(2) == head_dim,
                "layer ", l, "'s K/V pools are ", kp.sizes(), " and ", vp.sizes(),
                "; each is contiguous float32 (slots, kv_heads = ", kv_heads, ", head_dim = ", head_dim,
                ") on the CPU");
    const int g = is_sliding(l) ? 1 : 0;
    if (kp.size(0) < fewest[g]) {
      fewest[g] = kp.size(0);
      fewest_layer[g] = l;
    }
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = write_slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "position ", pos[r], " is past the rotary tables");
    TORCH_CHECK(slots[r] >= 0 && (fewest_layer[0] < 0 || slots[r] < fewest[0]), "row ", r, " writes slot ",
                slots[r], ", outside the pools (layer ", fewest_layer[0], "'s hold ", fewest[0], ")");
    TORCH_CHECK(local_slots == nullptr || (local_slots[r] >= 0 && (fewest_layer[1] < 0 || local_slots[r] < fewest[1])),
                "row ", r, " writes sliding slot ", local_slots == nullptr ? 0 : local_slots[r],
                ", outside the sliding pools (layer ", fewest_layer[1], "'s hold ", fewest[1], ")");
  }
  TORCH_CHECK(fewest_layer[0] < 0 || checked.reach <= fewest[0], "row ", checked.widest_row, " reads slot ",
              checked.reach - 1, ", outside the pools (layer ", fewest_layer[0], "'s hold ", fewest[0], ")");
  TORCH_CHECK(fewest_layer[1] < 0 || local_checked.reach <= fewest[1], "row ", local_checked.widest_row,
              " reads sliding slot ", local_checked.reach - 1, ", outside the sliding pools (layer ",
              fewest_layer[1], "'s hold ", fewest[1], ")");
  for (size_t i = 0; i < biases.size(); ++i)
    TORCH_CHECK(biases[i].scalar_type() == torch::kFloat && biases[i].is_contiguous() && biases[i].device().is_cpu() &&
                    biases[i].numel() == qkv_size,
                "block ", i, "'s QKV bias is ", biases[i].numel(), " contiguous float32 on the CPU, not ",
                biases[i].numel(), " ", biases[i].scalar_type());
  for (size_t i = 0; i < qk_norms.size(); ++i)
    TORCH_CHECK(qk_norms[i].scalar_type() == torch::kFloat && qk_norms[i].is_contiguous() &&
                    qk_norms[i].device().is_cpu() && qk_norms[i].numel() == head_dim,
                "query/key norm ", i, " is ", head_dim, " contiguous float32 on the CPU, not ", qk_norms[i].numel(),
                " ", qk_norms[i].scalar_type());
  // mats[1:] as the 4 * layers + 1 matrices, each its parts, checked against the config's shapes
  std::vector<Stack> ws;
  int64_t next_tensor = 1;
  auto stack_of = [&](int64_t slot, int64_t rows, int64_t cols) {
    Stack st;
    int64_t total = 0;
    for (int64_t k = 0; k < parts[slot]; ++k, ++next_tensor) {
      const int64_t r = parts[slot] == 1 ? rows : part_rows[next_tensor];
      st.parts.push_back(weight_of(mats[next_tensor], kinds[next_tensor], r, cols));
      total += r;
    }
    TORCH_CHECK(total == rows, "matrix ", slot, "'s parts hold ", total, " rows; the config implies ", rows);
    ws.push_back(std::move(st));
  };
  for (int64_t l = 0; l < layers; ++l) {
    stack_of(1 + 4 * l, qkv_size, hidden);
    stack_of(2 + 4 * l, hidden, q_size);
    stack_of(3 + 4 * l, 2 * intermediate, hidden);
    stack_of(4 + 4 * l, hidden, intermediate);
  }
  stack_of(4 * layers + 1, vocab_rows, hidden);
  auto weight = [&](int64_t i) -> const Stack& { return ws[i - 1]; };  // i: the matrix's index
  auto f32 = torch::dtype(torch::kFloat);
  torch::Tensor x = embed_rows(ids, mats[0], kinds[0], hidden);  // (B, H)
  auto h = torch::empty({b, hidden}, f32), tmp = torch::empty({b, hidden}, f32);
  auto qkv = torch::empty({b, qkv_size}, f32), q = torch::empty({b, heads, head_dim}, f32);
  auto gu = torch::empty({b, 2 * intermediate}, f32), act = torch::empty({b, intermediate}, f32);
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *tp = tmp.data_ptr<float>();
  float *qkvp = qkv.data_ptr<float>(), *qp = q.data_ptr<float>();
  float *gup = gu.data_ptr<float>(), *ap = act.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const double scale = attn_scale > 0 ? attn_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
  if (embed_scale != 1.0) {  // Gemma's sqrt(hidden), rounded to fp32 first as transformers does
    const float e = static_cast<float>(embed_scale);
    for (int64_t i = 0; i < b * hidden; ++i) xp[i] *= e;
  }

  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor &kp = k_pools[l], &vp = v_pools[l];
    const bool sl = is_sliding(l);
    const int64_t* wslots = sl ? local_slots : slots;
    const float *lcp = sl ? local_cp : cp, *lsp = sl ? local_sp : sp;
    rms_norm(xp, norms[2 * l].data_ptr<float>(), b, hidden, eps, hp);
    const Stack &w_o = weight(2 + 4 * l), &w_gu = weight(3 + 4 * l), &w_down = weight(4 + 4 * l);
    const Stack& w_next = weight(5 + 4 * l);  // the next block's QKV, or after the last block the head
    matmul_stack(hp, b, weight(1 + 4 * l), qkvp, int8, &w_o);
    for (int64_t r = 0; r < b; ++r) {  // (bias, per-head norms,) rotate q and k, store k and v, gather q
      float* row = qkvp + r * qkv_size;
      if (!biases.empty()) {
        const float* bias = biases[l].data_ptr<float>();
        for (int64_t i = 0; i < qkv_size; ++i) row[i] += bias[i];
      }
      if (!qk_norms.empty()) {  // each head of q and of k normed over head_dim, in place
        rms_norm(row, qk_norms[2 * l].data_ptr<float>(), heads, head_dim, eps, row);
        rms_norm(row + q_size, qk_norms[2 * l + 1].data_ptr<float>(), kv_heads, head_dim, eps, row + q_size);
      }
      const float *c = lcp + pos[r] * head_dim, *s = lsp + pos[r] * head_dim;
      for (int64_t hh = 0; hh < heads + kv_heads; ++hh) {
        float* v = row + hh * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], e = v[i + half];
          v[i] = a * c[i] - e * s[i];
          v[i + half] = e * c[i + half] + a * s[i + half];
        }
      }
      std::memcpy(qp + r * q_size, row, q_size * 4);
      std::memcpy(kp.data_ptr<float>() + wslots[r] * kv_size, row + q_size, kv_size * 4);
      std::memcpy(vp.data_ptr<float>() + wslots[r] * kv_size, row + q_size + kv_size, kv_size * 4);
    }
    torch::Tensor attn = decode_attention_checked(q, kp, vp, sl ? local_checked : checked, scale);  // (B, heads, hd)
    matmul_stack(attn.data_ptr<float>(), b, w_o, tp, int8, &w_gu);
    if (!out_norms.empty()) rms_norm(tp, out_norms[2 * l].data_ptr<float>(), b, hidden, eps, tp);  // Gemma's
    for (int64_t i = 0; i < b * hidden; ++i) xp[i] += tp[i];
    rms_norm(xp, norms[2 * l + 1].data_ptr<float>(), b, hidden, eps, hp);
    matmul_stack(hp, b, w_gu, gup, int8, &w_down);
    for (int64_t r = 0; r < b; ++r) {
      const float *g = gup + r * 2 * intermediate, *u = g + intermediate;
      float* a = ap + r * intermediate;
      if (gelu)
        gelu_mul(g, u, a, intermediate);
      else
        silu_mul(g, u, a, intermediate);
    }
    matmul_stack(ap, b, w_down, tp, int8, &w_next);
    if (!out_norms.empty()) rms_norm(tp, out_norms[2 * l + 1].data_ptr<float>(), b, hidden, eps, tp);
    for (int64_t i = 0; i < b * hidden; ++i) xp[i] += tp[i];
  }
  rms_norm(xp, norms[2 * layers].data_ptr<float>(), b, hidden, eps, hp);
  auto logits = torch::empty({b, vocab_rows}, f32);
  matmul_stack(hp, b, weight(4 * layers + 1), logits.data_ptr<float>(), int8, nullptr);
  return logits;
}
