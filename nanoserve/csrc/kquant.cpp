// Linears over the other block types of a Q4_K_M or Q5_K_M file, read as the file holds them (CPU).
//
//   kind  type   values  bytes  a value (kquants.py has the layouts)
//    7    Q4_0     32     18    d * (q - 8)
//    8    Q5_0     32     22    d * (q - 16)
//    9    Q5_1     32     24    d * q + m
//   10    Q4_K    256    144    (d * sc_j) * q - (dmin * m_j), eight sub-blocks j of 32
//   11    Q5_K    256    176    as Q4_K with a fifth bit
//   12    Q6_K    256    210    (d * sc_j) * (q - 32), sixteen sub-blocks j of 16, sc_j int8
//
// Every kernel reads a row 32 values at a time (a "group": a block, or an eighth of a
// super-block): the group's codes as 32 unsigned bytes q (at most 63) and, for each half of it,
// a scale s and an offset o. The fp32 path's weight is fma(s, c, o), c the code less the type's
// offset (8, 16 or 32 for Q4_0, Q5_0, Q6_K; else 0). Against gguf's dequantization:
//   Q4_0/Q5_0: s = d, o = -0: d * (q - off), exact, the sign of a zero included (-0 + -0 is -0).
//   Q5_1: s = d, o = m: d * q is exact and the add rounds once, as numpy's does.
//   Q4_K/Q5_K: s = d * sc, o = -(dmin * m), both exact (11 + 6 bits); s * q is exact (22 bits)
//     and the subtraction rounds once, as numpy's (d * sc) * q - dmin * m does.
//   Q6_K: s = d * sc (exact), o = -0: s * (q - 32) rounded once, as numpy's (d * sc) * (q - 32).
// So the fp32 path's weights, computed with one fused multiply-add, are bit for bit gguf's
// (tests/test_kquants.py over random blocks of every kind); only the order of the sums differs
// from a matmul over the dequantized matrix.
//
// The int8 path is llama.cpp's arithmetic. Against a 32-value block type x is quantized per 32
// (Q8_0: xd = max|x| / 127, xq = round(x / xd)); a block's dot is exact integer multiply-adds
// scaled by d * xd (Q4_0 and Q5_0 with their codes made signed, q - off), plus m * xd * sum(xq)
// for Q5_1's minimum. Against a K type x is quantized per 256 (Q8_K: the scale is the value of
// largest magnitude over -127, the codes clamped to 127, and the sums of each 16 codes kept): a
// super-block's dot is sum_j sc_j * (q . xq over sub-block j), an exact integer, times d * xd,
// less dmin * xd * sum_j m_j * (its codes' sum) (Q4_K, Q5_K), or with 32 * sc_j * (codes' sum)
// taken off inside the integer (Q6_K).
//
// The int8 kernels, chosen by the build: AVX2 (maddubs and madd on 32 codes, as llama.cpp's AVX2
// dots); AVX512-VNNI on 256 bits (one vpdpbusd instead, the codes kept unsigned and the offsets
// taken off through the sums of x; 32-value blocks four at a time, so that one float conversion
// and FMA serve four blocks); from 16 rows of x the tile kernel (below): 16 output rows unpacked
// once and multiplied 64 products an instruction; and Q5_0 kept in tiles of its own bytes (kind
// 13, below), the int8 path's layout for it wherever the tile kernels are built. Measured on a
// 2-core EPYC with AVX512-VNNI, all of Qwen2.5-Coder-0.5B's layer matrices of each type in turn
// (min of 5): Q5_0 (173 MB) against 1, 4, 8 and 16 rows of x took 4.9, 10.0, 19.3 and 37.2 ms
// in the file's layout and 4.6-5.1, 4.9-5.2, 7.6 and 12.2 ms in tiles; Q6_K (43 MB) 1.0, 2.6,
// 4.8, 9.1 ms with the rows kernel against 7.3 ms at 8 rows and 8.4 at 16 with the unpacking
// tile kernel, whence its threshold of 16 rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "nanoserve.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NANOSERVE_KAVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// the int8 path's dot products as one vpdpbusd each (unsigned codes times signed activations,
// eight lanes of four products summed), instead of AVX2's sign, maddubs and madd
#define NANOSERVE_KVNNI 1
#endif
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t Q4_0 = 7, Q5_0 = 8, Q5_1 = 9, Q4_K = 10, Q5_K = 11, Q6_K = 12;
constexpr int64_t Q5_0_TILES = 13;  // Q5_0 in tiles of 16 rows (below, and quant.py's tile_rows)
constexpr int64_t KTILE_ROWS = 16, Q5T_BLOCK = 16 * 22;  // a tile's rows; one block of its 16 rows
constexpr int64_t GROUP = 32, SUPER = 256;

inline bool is_super(int64_t kind) { return kind >= Q4_K && kind <= Q6_K; }
// what the fp32 path takes off a code before scaling it
template <int64_t KIND>
constexpr int code_offset() {
  return KIND == Q4_0 ? 8 : KIND == Q5_0 ? 16 : KIND == Q6_K ? 32 : 0;
}
inline int64_t kind_values(int64_t kind) { return is_super(kind) ? SUPER : GROUP; }
constexpr int64_t kind_bytes(int64_t kind) {
  constexpr int64_t bytes[] = {18, 22, 24, 144, 176, 210, 22};
  return bytes[kind - Q4_0];
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef NANOSERVE_KAVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K/Q5_K's twelve bytes of scales and mins: sub-block j's 6-bit scale and min.
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Group gi of a row: where its block starts and which group of the block it is.
template <int64_t KIND>
inline const uint8_t* block_of(const uint8_t* row, int64_t gi, int& j) {
  if constexpr (KIND >= Q4_K) {
    j = static_cast<int>(gi % 8);
    return row + (gi / 8) * kind_bytes(KIND);
  } else {
    j = 0;
    return row + gi * kind_bytes(KIND);
  }
}

// A group's scales: the float scale and offset of each half (fp32 path), and the integers the
// int8 path multiplies by: isc[half] (Q6_K: the two sub-blocks' scales; Q4_K/Q5_K: the one
// sub-block's, twice), imin (Q4_K/Q5_K's 6-bit min), and the block's d, dmin or m.
struct GroupScales {
  float s[2], o[2];
  int isc[2], imin;
  float d, dmin;
};

template <int64_t KIND>
inline GroupScales group_scales(const uint8_t* b, int j) {
  GroupScales g{};
  if constexpr (KIND == Q4_0 || KIND == Q5_0) {
    g.d = half_at(b);
    g.s[0] = g.s[1] = g.d;
    g.o[0] = g.o[1] = -0.0f;
  } else if constexpr (KIND == Q5_1) {
    g.d = half_at(b);
    g.dmin = half_at(b + 2);  // the minimum m
    g.s[0] = g.s[1] = g.d;
    g.o[0] = g.o[1] = g.dmin;
  } else if constexpr (KIND == Q4_K || KIND == Q5_K) {
    g.d = half_at(b);
    g.dmin = half_at(b + 2);
    int sc, m;
    scale_min_k4(b + 4, j, sc, m);
    g.isc[0] = g.isc[1] = sc;
    g.imin = m;
    g.s[0] = g.s[1] = g.d * static_cast<float>(sc);
    g.o[0] = g.o[1] = -(g.dmin * static_cast<float>(m));
  } else {  // Q6_K: group j is sub-blocks 2j and 2j + 1
    g.d = half_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int h = 0; h < 2; ++h) {
      g.isc[h] = sc[2 * j + h];
      g.s[h] = g.d * static_cast<float>(g.isc[h]);
      g.o[h] = -0.0f;
    }
  }
  return g;
}

// A group's 32 codes, unsigned, one byte each, value i of the group in byte i.
template <int64_t KIND>
inline void group_codes(const uint8_t* b, int j, uint8_t* q) {
  if constexpr (KIND == Q4_0) {
    for (int i = 0; i < 16; ++i) q[i] = b[2 + i] & 0x0F, q[i + 16] = b[2 + i] >> 4;
  } else if constexpr (KIND == Q5_0 || KIND == Q5_1) {
    const int at = KIND == Q5_0 ? 2 : 4;
    const uint32_t qh = u32_at(b + at);
    for (int i = 0; i < 16; ++i) {
      q[i] = (b[at + 4 + i] & 0x0F) | (((qh >> i) & 1) << 4);
      q[i + 16] = (b[at + 4 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
    }
  } else if constexpr (KIND == Q4_K || KIND == Q5_K) {
    const uint8_t* qs = b + (KIND == Q5_K ? 48 : 16) + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int i = 0; i < 32; ++i) {
      q[i] = (qs[i] >> shift) & 0x0F;
      if constexpr (KIND == Q5_K) q[i] |= ((b[16 + i] >> j) & 1) << 4;
    }
  } else {  // Q6_K
    const int half = j / 4, k = j % 4;
    const uint8_t* ql = b + 64 * half + 32 * (k & 1);
    const uint8_t* qh = b + 128 + 32 * half;
    const int shift = k >= 2 ? 4 : 0;
    for (int i = 0; i < 32; ++i) q[i] = ((ql[i] >> shift) & 0x0F) | (((qh[i] >> (2 * k)) & 3) << 4);
  }
}

template <int64_t KIND>
void row_floats(const uint8_t* row, int64_t cols, float* out) {
  uint8_t q[GROUP];
  for (int64_t gi = 0; gi < cols / GROUP; ++gi) {
    int j;
    const uint8_t* b = block_of<KIND>(row, gi, j);
    const GroupScales g = group_scales<KIND>(b, j);
    group_codes<KIND>(b, j, q);
    for (int i = 0; i < GROUP; ++i)
      out[gi * GROUP + i] = std::fma(g.s[i / 16], static_cast<float>(q[i] - code_offset<KIND>()), g.o[i / 16]);
  }
}

// x quantized for the int8 path: per 32 (Q8_0) or per 256 (Q8_K) values of each row.
struct XQ {
  std::vector<int8_t> q;   // (m, cols)
  std::vector<float> d;    // (m, cols / block): the scale
  std::vector<float> s;    // per 32: d * sum(q) (Q5_1's minimum term)
  std::vector<int32_t> bs; // per 256: the sums of each 16 codes, (m, cols / 16); per 32: sum(q)
};

// v * scale rounded to the nearest integer (ties to even), for n values (a multiple of 8 on AVX2),
// clamped above at `top`; returns their sum.
inline int round_block(const float* v, float scale, int64_t n, int top, int8_t* q) {
  int sum = 0;
  int64_t k = 0;
#ifdef NANOSERVE_KAVX2
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i hi = _mm256_set1_epi32(top);
  __m256i total = _mm256_setzero_si256();
  for (; k + 8 <= n; k += 8) {
    const __m256i r = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + k), s)), hi);
    total = _mm256_add_epi32(total, r);
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(w16, w16));
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total);
  for (int i = 0; i < 8; ++i) sum += lanes[i];
#endif
  for (; k < n; ++k) {
    const int r = std::min(top, static_cast<int>(std::nearbyint(v[k] * scale)));
    q[k] = static_cast<int8_t>(r);
    sum += r;
  }
  return sum;
}

XQ quantize_q8_0(const float* x, int64_t m, int64_t cols) {
  const int64_t groups = cols / GROUP;
  XQ out{std::vector<int8_t>(m * cols), std::vector<float>(m * groups), std::vector<float>(m * groups),
         std::vector<int32_t>(m * groups)};
  at::parallel_for(0, m * groups, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* xb = x + i * GROUP;
      float amax = 0.0f;
      for (int k = 0; k < GROUP; ++k) amax = std::max(amax, std::fabs(xb[k]));
      const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
      const int sum = round_block(xb, id, GROUP, 127, out.q.data() + i * GROUP);
      out.d[i] = d;
      out.s[i] = d * static_cast<float>(sum);
      out.bs[i] = sum;
    }
  });
  return out;
}

XQ quantize_q8_k(const float* x, int64_t m, int64_t cols) {
  const int64_t supers = cols / SUPER;
  XQ out{std::vector<int8_t>(m * cols), std::vector<float>(m * supers), {}, std::vector<int32_t>(m * cols / 16)};
  at::parallel_for(0, m * supers, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* xb = x + i * SUPER;
      float amax = 0.0f, max = 0.0f;
      for (int k = 0; k < SUPER; ++k)
        if (std::fabs(xb[k]) > amax) amax = std::fabs(xb[k]), max = xb[k];
      int8_t* q = out.q.data() + i * SUPER;
      if (amax == 0.0f) {
        out.d[i] = 0.0f;
        std::memset(q, 0, SUPER);
      } else {
        const float iscale = -127.0f / max;
        for (int k = 0; k < SUPER; k += 16) out.bs[i * (SUPER / 16) + k / 16] = round_block(xb + k, iscale, 16, 127, q + k);
        out.d[i] = 1.0f / iscale;
        continue;
      }
      for (int k = 0; k < SUPER / 16; ++k) out.bs[i * (SUPER / 16) + k] = 0;
    }
  });
  return out;
}

// --- portable loops --------------------------------------------------------------------------

template <int64_t KIND>
void rows_f32_portable(const float* x, int64_t m, const uint8_t* w, int64_t cols, int64_t row_bytes, float* y,
                       int64_t ldy, int64_t n0, int64_t n1) {
  std::vector<float> wf(cols);
  for (int64_t n = n0; n < n1; ++n) {
    row_floats<KIND>(w + n * row_bytes, cols, wf.data());
    for (int64_t r = 0; r < m; ++r) {
      float t = 0.0f;
      for (int64_t gi = 0; gi < cols / GROUP; ++gi) {
        float s = 0.0f;
        for (int i = 0; i < GROUP; ++i) s += wf[gi * GROUP + i] * x[r * cols + gi * GROUP + i];
        t += s;
      }
      y[r * ldy + n] = t;
    }
  }
}

template <int64_t KIND>
void rows_q8_portable(const XQ& xq, int64_t m, const uint8_t* w, int64_t cols, int64_t row_bytes, float* y,
                      int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t groups = cols / GROUP;
  uint8_t q[GROUP];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* xr = xq.q.data() + r * cols;
      float t = 0.0f;
      if constexpr (KIND >= Q4_K) {
        for (int64_t sb = 0; sb < cols / SUPER; ++sb) {
          int32_t sumi = 0, summ = 0;
          GroupScales g{};
          for (int j = 0; j < 8; ++j) {
            int jj;
            const uint8_t* b = block_of<KIND>(row, sb * 8 + j, jj);
            g = group_scales<KIND>(b, j);
            group_codes<KIND>(b, j, q);
            const int8_t* xb = xr + sb * SUPER + j * GROUP;
            const int32_t* bs = xq.bs.data() + r * (cols / 16) + sb * 16 + 2 * j;
            for (int h = 0; h < 2; ++h) {
              int32_t dot = 0;
              for (int i = 16 * h; i < 16 * h + 16; ++i) dot += q[i] * xb[i];
              if constexpr (KIND == Q6_K) dot -= 32 * bs[h];
              sumi += g.isc[h] * dot;
            }
            if constexpr (KIND != Q6_K) summ += g.imin * (bs[0] + bs[1]);
          }
          const float xd = xq.d[r * (cols / SUPER) + sb];
          t += g.d * xd * static_cast<float>(sumi);
          if constexpr (KIND != Q6_K) t -= g.dmin * xd * static_cast<float>(summ);
        }
      } else {
        for (int64_t gi = 0; gi < groups; ++gi) {
          const uint8_t* b = row + gi * kind_bytes(KIND);
          const GroupScales g = group_scales<KIND>(b, 0);
          group_codes<KIND>(b, 0, q);
          const int off = KIND == Q4_0 ? 8 : KIND == Q5_0 ? 16 : 0;
          int32_t dot = 0;
          for (int i = 0; i < GROUP; ++i) dot += (q[i] - off) * xr[gi * GROUP + i];
          const int64_t at = r * groups + gi;
          t += g.d * xq.d[at] * static_cast<float>(dot);
          if constexpr (KIND == Q5_1) t += g.dmin * xq.s[at];
        }
      }
      y[r * ldy + n] = t;
    }
  }
}

#ifdef NANOSERVE_KAVX2
// --- AVX2 ---------------------------------------------------------------------------------------

inline float hsum8(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// 32 bits to 32 bytes: byte i is 0x10 where bit i is set, else 0.
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3,
                       3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// The group's 32 codes in one register (group_codes, vectorised).
template <int64_t KIND>
inline __m256i codes_avx2(const uint8_t* b, int j) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (KIND <= Q5_1) {
    const int at = KIND == Q4_0 ? 2 : KIND == Q5_0 ? 6 : 8;
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + at));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), low4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    // the fifth bits as a byte mask: 16 added where a bit is set (two instructions, not seven)
    if constexpr (KIND != Q4_0)
      q = _mm256_mask_add_epi8(q, _cvtu32_mask32(u32_at(b + at - 4)), q, _mm256_set1_epi8(0x10));
#else
    if constexpr (KIND != Q4_0) q = _mm256_or_si256(q, fifth_bits(u32_at(b + at - 4)));
#endif
    return q;
  } else if constexpr (KIND == Q4_K || KIND == Q5_K) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (KIND == Q5_K ? 48 : 16) + 32 * (j / 2)));
    __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(qs, 4) : qs, low4);
    if constexpr (KIND == Q5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
      q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
    return q;
  } else {
    const int half = j / 4, k = j % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (k & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
    const __m256i lo = _mm256_and_si256(k >= 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
}

// fp32 activations: MR rows of x against outputs [n0, n1); each group widened to 32 floats once
// (one FMA each: s * q + o) and used for all MR rows.
template <int64_t KIND, int MR>
void rows_f32(const float* x, const uint8_t* w, int64_t cols, int64_t row_bytes, float* y, int64_t ldy, int64_t n0,
              int64_t n1) {
  constexpr int A = MR == 1 ? 2 : 1;
  const int64_t groups = cols / GROUP;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[MR][A];
    for (int r = 0; r < MR; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < groups; ++gi) {
      int j;
      const uint8_t* b = block_of<KIND>(row, gi, j);
      const GroupScales g = group_scales<KIND>(b, j);
      const __m256i q = _mm256_sub_epi8(codes_avx2<KIND>(b, j), _mm256_set1_epi8(code_offset<KIND>()));
      const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
      const __m256 s0 = _mm256_set1_ps(g.s[0]), s1 = _mm256_set1_ps(g.s[1]);
      const __m256 o0 = _mm256_set1_ps(g.o[0]), o1 = _mm256_set1_ps(g.o[1]);
      __m256 wv[4];
      wv[0] = _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), o0);
      wv[1] = _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))), o0);
      wv[2] = _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), o1);
      wv[3] = _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))), o1);
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * cols + gi * GROUP;
        for (int i = 0; i < 4; ++i) acc[r][i % A] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(xr + 8 * i), acc[r][i % A]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      __m256 s = acc[r][0];
      for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[r][a]);
      y[r * ldy + n] = hsum8(s);
    }
  }
}

#ifdef NANOSERVE_KVNNI
inline uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The int8 path over 32-value blocks with VNNI, four blocks at a time: each block's dot stays in
// the eight int32 lanes of one vpdpbusd until the four are folded (two rounds of hadd) into one
// vector of four exact integer dots, so the conversion to float, the scale d * xd and the FMA are
// done once for four blocks instead of once a block. A decode step that verifies drafts
// multiplies 2-8 rows of x, where the per-block float work, not the weights' bytes, set the
// price (a 4-row product of a 4864 x 896 Q5_0 matrix took 2.3x one row's time). The integer dots
// are rows_q8_0's exactly; the float sums run four lanes wide, the same order for every row of
// x, whatever MR (batch invariance). Blocks past a multiple of four take the one-block loop.
constexpr int64_t PREFETCH = 4096;

template <int64_t KIND, int MR>
void rows_q8_0_vnni(const XQ& xq, int64_t r0, const uint8_t* w, int64_t cols, int64_t row_bytes, float* y,
                    int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int64_t KB = kind_bytes(KIND);
  constexpr int off = KIND == Q4_0 ? 8 : KIND == Q5_0 ? 16 : 0;
  const int64_t groups = cols / GROUP, whole = groups / 4 * 4;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m128 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm_setzero_ps();
    for (int64_t g0 = 0; g0 < whole; g0 += 4) {
      const uint8_t* b = row + g0 * KB;
      // the rows are read in order: ask for the bytes PREFETCH ahead (as the tile kernels do;
      // measured here neither faster nor slower than the hardware's prefetcher alone)
      _mm_prefetch(reinterpret_cast<const char*>(b + PREFETCH), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + PREFETCH + 64), _MM_HINT_T0);
      const __m256i q0 = codes_avx2<KIND>(b, 0), q1 = codes_avx2<KIND>(b + KB, 0);
      const __m256i q2 = codes_avx2<KIND>(b + 2 * KB, 0), q3 = codes_avx2<KIND>(b + 3 * KB, 0);
      const __m128 dw = _mm_cvtph_ps(_mm_setr_epi16(static_cast<int16_t>(u16_at(b)), static_cast<int16_t>(u16_at(b + KB)),
                                                    static_cast<int16_t>(u16_at(b + 2 * KB)),
                                                    static_cast<int16_t>(u16_at(b + 3 * KB)), 0, 0, 0, 0));
      [[maybe_unused]] __m128 mw;
      if constexpr (KIND == Q5_1)
        mw = _mm_cvtph_ps(_mm_setr_epi16(static_cast<int16_t>(u16_at(b + 2)), static_cast<int16_t>(u16_at(b + KB + 2)),
                                         static_cast<int16_t>(u16_at(b + 2 * KB + 2)),
                                         static_cast<int16_t>(u16_at(b + 3 * KB + 2)), 0, 0, 0, 0));
      for (int r = 0; r < MR; ++r) {
        const int64_t at = (r0 + r) * groups + g0;
        const int8_t* xb = xq.q.data() + (r0 + r) * cols + g0 * GROUP;
        const __m256i z = _mm256_setzero_si256();
        const __m256i s0 = _mm256_dpbusd_epi32(z, q0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));
        const __m256i s1 = _mm256_dpbusd_epi32(z, q1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 32)));
        const __m256i s2 = _mm256_dpbusd_epi32(z, q2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 64)));
        const __m256i s3 = _mm256_dpbusd_epi32(z, q3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 96)));
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
        __m128i dots = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        if constexpr (off != 0)  // sum (q - off) x = sum q x - off sum(x), exactly
          dots = _mm_sub_epi32(dots, _mm_mullo_epi32(_mm_set1_epi32(off),
                                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq.bs.data() + at))));
        acc[r] = _mm_fmadd_ps(_mm_mul_ps(dw, _mm_loadu_ps(xq.d.data() + at)), _mm_cvtepi32_ps(dots), acc[r]);
        if constexpr (KIND == Q5_1) acc[r] = _mm_fmadd_ps(mw, _mm_loadu_ps(xq.s.data() + at), acc[r]);
      }
    }
    float tail[MR] = {};
    for (int64_t gi = whole; gi < groups; ++gi) {
      const uint8_t* b = row + gi * KB;
      const float d = half_at(b);
      const __m256i uq = codes_avx2<KIND>(b, 0);
      for (int r = 0; r < MR; ++r) {
        const int64_t at = (r0 + r) * groups + gi;
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + (r0 + r) * cols + gi * GROUP));
        const __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), uq, xv);
        const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        const __m128i u = _mm_hadd_epi32(t, t);
        const int32_t dot = _mm_cvtsi128_si32(_mm_hadd_epi32(u, u)) - off * xq.bs[at];
        tail[r] += d * xq.d[at] * static_cast<float>(dot);
        if constexpr (KIND == Q5_1) tail[r] += half_at(b + 2) * xq.s[at];
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m128 a = acc[r];
      const __m128 s = _mm_add_ps(a, _mm_movehl_ps(a, a));
      y[r * ldy + n] = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1))) + tail[r];
    }
  }
}
#endif

// The int8 path over 32-value blocks (Q8_0 activations): as quant.cpp's Q8_0 and Q4_1 kernels.
template <int64_t KIND, int MR>
void rows_q8_0(const XQ& xq, int64_t r0, const uint8_t* w, int64_t cols, int64_t row_bytes, float* y, int64_t ldy,
               int64_t n0, int64_t n1) {
  const int64_t groups = cols / GROUP;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[MR];
    float mins[MR] = {};
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < groups; ++gi) {
      const uint8_t* b = row + gi * kind_bytes(KIND);
      const float d = half_at(b);
#ifdef NANOSERVE_KVNNI
      // sum (q - off) x = sum q x - off sum(x): the second term starts lane 0's sum, exactly
      const __m256i uq = codes_avx2<KIND>(b, 0);
      constexpr int off = KIND == Q4_0 ? 8 : KIND == Q5_0 ? 16 : 0;
      for (int r = 0; r < MR; ++r) {
        const int64_t at = (r0 + r) * groups + gi;
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + (r0 + r) * cols + gi * GROUP));
        const __m256i start = _mm256_zextsi128_si256(_mm_cvtsi32_si128(-off * xq.bs[at]));
        const __m256 dots = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(start, uq, xv));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xq.d[at]), dots, acc[r]);
        if constexpr (KIND == Q5_1) mins[r] += half_at(b + 2) * xq.s[at];
      }
#else
      __m256i q = codes_avx2<KIND>(b, 0), uq = q;
      if constexpr (KIND != Q5_1) {  // signed codes q - off; the sign moves onto x
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(KIND == Q4_0 ? 8 : 16));
        uq = _mm256_sign_epi8(q, q);
      }
      for (int r = 0; r < MR; ++r) {
        const int64_t at = (r0 + r) * groups + gi;
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + (r0 + r) * cols + gi * GROUP));
        if constexpr (KIND != Q5_1) xv = _mm256_sign_epi8(xv, q);
        const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(uq, xv), ones));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xq.d[at]), dots, acc[r]);
        if constexpr (KIND == Q5_1) mins[r] += half_at(b + 2) * xq.s[at];
      }
#endif
    }
    for (int r = 0; r < MR; ++r) y[r * ldy + n] = hsum8(acc[r]) + mins[r];
  }
}

// The int8 path over super-blocks (Q8_K activations): per super-block and row, the integer
// sum_j sc_j * (codes . xq) in eight int32 lanes, then one FMA by d * xd.
template <int64_t KIND, int MR>
void rows_q8_k(const XQ& xq, int64_t r0, const uint8_t* w, int64_t cols, int64_t row_bytes, float* y, int64_t ldy,
               int64_t n0, int64_t n1) {
  const int64_t supers = cols / SUPER;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[MR];
    float mins[MR] = {};
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < supers; ++sb) {
      const uint8_t* b = row + sb * kind_bytes(KIND);
      __m256i sumi[MR];
      int32_t off[MR] = {};  // Q4_K/Q5_K: sum_j m_j * codes' sum; Q6_K: 32 * sum_j sc_j * codes' sum
      for (int r = 0; r < MR; ++r) sumi[r] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const GroupScales g = group_scales<KIND>(b, j);
        const __m256i q = codes_avx2<KIND>(b, j);
#ifdef NANOSERVE_KVNNI
        // lanes 0-3 are the group's first 16 values, 4-7 its second: each half times its scale
        // (the offsets, 32 sum(x) or the mins, are taken off once a super-block, below)
        const __m256i sc = _mm256_set_m128i(_mm_set1_epi32(g.isc[1]), _mm_set1_epi32(g.isc[0]));
        for (int r = 0; r < MR; ++r) {
          const int8_t* xb = xq.q.data() + (r0 + r) * cols + sb * SUPER + j * GROUP;
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q, xv), sc));
        }
#else
        const __m256i sc = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(g.isc[1])),
                                            _mm_set1_epi16(static_cast<int16_t>(g.isc[0])));
        for (int r = 0; r < MR; ++r) {
          const int8_t* xb = xq.q.data() + (r0 + r) * cols + sb * SUPER + j * GROUP;
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), sc));
          const int32_t* bs = xq.bs.data() + (r0 + r) * (cols / 16) + sb * 16 + 2 * j;
          if constexpr (KIND == Q6_K)
            off[r] += 32 * (g.isc[0] * bs[0] + g.isc[1] * bs[1]);
          else
            off[r] += g.imin * (bs[0] + bs[1]);
        }
#endif
      }
      const float d = half_at(KIND == Q6_K ? b + 208 : b);
      const float dmin = KIND == Q6_K ? 0.0f : half_at(b + 2);
#ifdef NANOSERVE_KVNNI
      {
        // per 16 values i of the super-block, the integer its code sum bs_i is multiplied by:
        // Q6_K's 32 * sc_i (taken off sumi), Q4_K/Q5_K's min m_(i/2) (into off)
        __m256i k0, k1;
        if constexpr (KIND == Q6_K) {
          const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
          k0 = _mm256_slli_epi32(_mm256_cvtepi8_epi32(sc8), 5);
          k1 = _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)), 5);
        } else {
          alignas(32) int32_t mm[16];
          for (int j = 0; j < 8; ++j) {
            int sc, m;
            scale_min_k4(b + 4, j, sc, m);
            mm[2 * j] = mm[2 * j + 1] = m;
          }
          k0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(mm));
          k1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(mm + 8));
        }
        for (int r = 0; r < MR; ++r) {
          const int32_t* bs = xq.bs.data() + (r0 + r) * (cols / 16) + sb * 16;
          const __m256i t = _mm256_add_epi32(
              _mm256_mullo_epi32(k0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs))),
              _mm256_mullo_epi32(k1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + 8))));
          if constexpr (KIND == Q6_K) {
            sumi[r] = _mm256_sub_epi32(sumi[r], t);
          } else {
            const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            const __m128i u = _mm_hadd_epi32(h, h);
            off[r] = _mm_cvtsi128_si32(_mm_hadd_epi32(u, u));
          }
        }
      }
#endif
      for (int r = 0; r < MR; ++r) {
        const float xd = xq.d[(r0 + r) * supers + sb];
        if constexpr (KIND == Q6_K) {
#ifndef NANOSERVE_KVNNI
          sumi[r] = _mm256_sub_epi32(sumi[r], _mm256_setr_epi32(off[r], 0, 0, 0, 0, 0, 0, 0));
#endif
        } else {
          mins[r] -= dmin * xd * static_cast<float>(off[r]);
        }
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
      }
    }
    for (int r = 0; r < MR; ++r) y[r * ldy + n] = hsum8(acc[r]) + mins[r];
  }
}

#if defined(NANOSERVE_KVNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define NANOSERVE_KTILES 1
// Many rows of x (a prefill, a wide decode step): 16 output rows at a time, their codes unpacked
// once into the layout of quant.cpp's tiles (vector c of a group holds codes 4c..4c+3 of each of
// the 16 rows, one 32-bit lane a row) so that one 512-bit vpdpbusd multiplies four columns of 16
// rows by four activations broadcast to every lane; the unpacking is then shared by every row of
// x instead of redone per four. The integer sums are rows_q8_0's and rows_q8_k's exactly.
constexpr int64_t KTILE = 16;
constexpr int64_t TILE_MIN_ROWS = 16;  // from 16 rows of x the tiles win (the header's measurement)

struct TileGroup {
  __m512i codes[8];
  __m512 d, dmin;         // the rows' d, and dmin (Q4_K, Q5_K) or m (Q5_1)
  __m512i isc[2], imin;   // K types: each half's integer scale, the 6-bit min
};

template <int64_t KIND>
void unpack_tile(const uint8_t* w, int64_t rows, int64_t cols, int64_t row_bytes, int64_t n0, TileGroup* out) {
  const int64_t groups = cols / GROUP;
  alignas(64) uint32_t codes[KTILE][8];
  alignas(64) float d[KTILE], dm[KTILE];
  alignas(64) int32_t sc0[KTILE], sc1[KTILE], mn[KTILE];
  const __m512i index = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120);
  for (int64_t gi = 0; gi < groups; ++gi) {
    for (int64_t n = 0; n < KTILE; ++n) {
      if (n0 + n >= rows) {  // past the last row: zero codes and scales, a zero output nobody keeps
        std::memset(codes[n], 0, 32);
        d[n] = dm[n] = 0.0f;
        sc0[n] = sc1[n] = mn[n] = 0;
        continue;
      }
      int j;
      const uint8_t* b = block_of<KIND>(w + (n0 + n) * row_bytes, gi, j);
      const GroupScales g = group_scales<KIND>(b, j);
      _mm256_store_si256(reinterpret_cast<__m256i*>(codes[n]), codes_avx2<KIND>(b, j));
      d[n] = g.d;
      dm[n] = g.dmin;
      sc0[n] = g.isc[0];
      sc1[n] = g.isc[1];
      mn[n] = g.imin;
    }
    TileGroup& t = out[gi];
    for (int c = 0; c < 8; ++c) t.codes[c] = _mm512_i32gather_epi32(_mm512_add_epi32(index, _mm512_set1_epi32(c)), codes, 4);
    t.d = _mm512_load_ps(d);
    t.dmin = _mm512_load_ps(dm);
    t.isc[0] = _mm512_load_si512(sc0);
    t.isc[1] = _mm512_load_si512(sc1);
    t.imin = _mm512_load_si512(mn);
  }
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// MR rows of x (from r0) against the unpacked tile whose first output row is n0.
template <int64_t KIND, int MR>
void tile_rows(const XQ& xq, int64_t r0, const TileGroup* tg, int64_t cols, float* y, int64_t ldy, int64_t n0,
               int64_t live) {
  const int64_t groups = cols / GROUP;
  __m512 acc[MR], macc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = macc[r] = _mm512_setzero_ps();
  if constexpr (KIND <= Q5_1) {
    constexpr int off = KIND == Q4_0 ? 8 : KIND == Q5_0 ? 16 : 0;
    for (int64_t gi = 0; gi < groups; ++gi) {
      const TileGroup& t = tg[gi];
      for (int r = 0; r < MR; ++r) {
        const int8_t* xb = xq.q.data() + (r0 + r) * cols + gi * GROUP;
        const int64_t at = (r0 + r) * groups + gi;
        __m512i s0 = _mm512_set1_epi32(-off * xq.bs[at]), s1 = _mm512_setzero_si512();
        for (int c = 0; c < 8; c += 2) {
          s0 = _mm512_dpbusd_epi32(s0, t.codes[c], bcast4(xb + 4 * c));
          s1 = _mm512_dpbusd_epi32(s1, t.codes[c + 1], bcast4(xb + 4 * c + 4));
        }
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(t.d, _mm512_set1_ps(xq.d[at])), dots, acc[r]);
        if constexpr (KIND == Q5_1) macc[r] = _mm512_fmadd_ps(t.dmin, _mm512_set1_ps(xq.s[at]), macc[r]);
      }
    }
  } else {
    const int64_t supers = cols / SUPER;
    for (int64_t sb = 0; sb < supers; ++sb) {
      __m512i sumi[MR], summ[MR];
      for (int r = 0; r < MR; ++r) sumi[r] = summ[r] = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        const TileGroup& t = tg[sb * 8 + j];
        for (int r = 0; r < MR; ++r) {
          const int8_t* xb = xq.q.data() + (r0 + r) * cols + sb * SUPER + j * GROUP;
          const int32_t* bs = xq.bs.data() + (r0 + r) * (cols / 16) + sb * 16 + 2 * j;
          __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
          if constexpr (KIND == Q6_K) {
            lo = _mm512_set1_epi32(-32 * bs[0]);
            hi = _mm512_set1_epi32(-32 * bs[1]);
          }
          for (int c = 0; c < 4; ++c) {
            lo = _mm512_dpbusd_epi32(lo, t.codes[c], bcast4(xb + 4 * c));
            hi = _mm512_dpbusd_epi32(hi, t.codes[c + 4], bcast4(xb + 16 + 4 * c));
          }
          if constexpr (KIND == Q6_K) {
            sumi[r] = _mm512_add_epi32(sumi[r], _mm512_add_epi32(_mm512_mullo_epi32(lo, t.isc[0]),
                                                                 _mm512_mullo_epi32(hi, t.isc[1])));
          } else {
            sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(_mm512_add_epi32(lo, hi), t.isc[0]));
            summ[r] = _mm512_add_epi32(summ[r], _mm512_mullo_epi32(t.imin, _mm512_set1_epi32(bs[0] + bs[1])));
          }
        }
      }
      const TileGroup& t = tg[sb * 8];
      for (int r = 0; r < MR; ++r) {
        const __m512 xd = _mm512_set1_ps(xq.d[(r0 + r) * supers + sb]);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(t.d, xd), _mm512_cvtepi32_ps(sumi[r]), acc[r]);
        if constexpr (KIND != Q6_K)
          macc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(t.dmin, xd), _mm512_cvtepi32_ps(summ[r]), macc[r]);
      }
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << live) - 1);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + n0, keep, _mm512_add_ps(acc[r], macc[r]));
}
#endif

#endif

// --- Q5_0 in tiles (kind 13) -------------------------------------------------------------------
//
// Most of a Q4_K_M file's bytes are Q5_0 (Qwen2.5-0.5B: 173 of its 400 MB a step; Gemma 3 270M's
// layers too), and rows_q8_0 pays for every block of every row of x: the codes unpacked (a fifth
// bit a value), then a float scale and FMA per block and row. Against one row of x that held the
// product at ~35 GB/s, below this machine's bandwidth, and against four rows (one decoding row
// and three drafts to verify) it took twice one row's time. So the int8 path keeps Q5_0 in tiles
// like quant.cpp's Q4_1 and Q8_0 (kinds 5, 6), in the file's own bytes, 22 a block and row: for
// tile t (rows 16t..16t+15) and block g, the 16 rows' fp16 scales (32 bytes), then their 32 fifth
// bits (64 bytes: a 32-bit lane a row, bit 8k + c the fifth bit of byte k of code vector c,
// below), then their 16 bytes of nibbles four at a time (4 x 64 bytes: vector c holds bytes
// 4c..4c+3 of each row, one 32-bit lane a row, as Q4_1's tiles). Vector c's low nibbles are codes
// 4c..4c+3 and its high nibbles 16 + 4c..16 + 4c + 3 (code vector c + 4); a fifth bit is one
// byte-mask test and one masked add of 16. So the block's 16 rows x 32 codes are unpacked once
// for every row of x, and one vpdpbusd multiplies four codes of 16 rows by four activations.
// (Byte k of vector c is code 4c + k either way, so the word's byte k holds the fifth bits of
// codes k, k + 4, ..., k + 28.)
// The integer dots are rows_q8_0's exactly (sum q x - 16 sum x); the float sums are one FMA a
// block and row of x, in the same order whatever the number of rows of x (batch invariance).
// quant.py's tile_rows / untile_rows convert, and hold every byte of the file's blocks.
inline int64_t q5t_bit(int c, int k) { return 4 * c + k; }  // the code whose fifth bit is bit 8k + c

// Row n of a Q5_0 tiles matrix as the file's bytes (22 a block): the portable paths' view.
void q5t_row(const uint8_t* w, int64_t cols, int64_t n, uint8_t* out) {
  const int64_t groups = cols / GROUP, lane = n % KTILE_ROWS;
  const uint8_t* tile = w + (n / KTILE_ROWS) * groups * Q5T_BLOCK;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = tile + g * Q5T_BLOCK;
    uint8_t* b = out + g * 22;
    std::memcpy(b, p + 2 * lane, 2);
    const uint32_t perm = u32_at(p + 32 + 4 * lane);
    uint32_t qh = 0;
    for (int c = 0; c < 8; ++c)
      for (int k = 0; k < 4; ++k) qh |= ((perm >> (8 * k + c)) & 1u) << q5t_bit(c, k);
    std::memcpy(b + 2, &qh, 4);
    for (int c = 0; c < 4; ++c) std::memcpy(b + 6 + 4 * c, p + 96 + 64 * c + 4 * lane, 4);
  }
}

#ifdef NANOSERVE_KTILES
template <int MR>
void tiles_q5_0(const XQ& xq, int64_t r0, const uint8_t* w, int64_t rows, int64_t cols, float* y, int64_t ldy,
                int64_t t0, int64_t t1) {
  const int64_t groups = cols / GROUP;
  const __m512i low4 = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(0x10);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * groups * Q5T_BLOCK;
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = tile + g * Q5T_BLOCK;
      // the weights stream once a token: ask for the lines 4 KB ahead (as quant.cpp's tiles do)
      for (int64_t o = 0; o < Q5T_BLOCK; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + 4096 + o), _MM_HINT_T0);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      const __m512i h = _mm512_loadu_si512(p + 32);
      __m512i q[8];
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(p + 96 + 64 * c);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        q[c] = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(h, _mm512_set1_epi8(static_cast<char>(1 << c))), lo,
                                    sixteen);
        q[c + 4] = _mm512_mask_add_epi8(
            hi, _mm512_test_epi8_mask(h, _mm512_set1_epi8(static_cast<char>(1 << (c + 4)))), hi, sixteen);
      }
      for (int r = 0; r < MR; ++r) {
        const int8_t* xb = xq.q.data() + (r0 + r) * cols + g * GROUP;
        const int64_t at = (r0 + r) * groups + g;
        __m512i s0 = _mm512_set1_epi32(-16 * xq.bs[at]), s1 = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          s0 = _mm512_dpbusd_epi32(s0, q[c], bcast4(xb + 4 * c));
          s1 = _mm512_dpbusd_epi32(s1, q[c + 4], bcast4(xb + 16 + 4 * c));
        }
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xq.d[at])), dots, acc[r]);
      }
    }
    const int64_t n0 = t * KTILE_ROWS, live = std::min<int64_t>(KTILE_ROWS, rows - n0);
    const __mmask16 keep = static_cast<__mmask16>((1u << live) - 1);
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + n0, keep, acc[r]);
  }
}
#endif

// y = x W^T over a Q5_0 tiles matrix: the tiles kernel for the int8 path where it is built; the
// fp32 path, and builds without AVX512-VNNI, read each row back into the file's bytes first (a
// slow path: quant.py makes tiles only for int8 activations on a build that has the kernel).
void matmul_q5_0_tiles(const float* x, int64_t m, const uint8_t* w, int64_t rows, int64_t cols, float* y, int64_t ldy,
                       bool int8) {
  const int64_t row_bytes = cols / GROUP * 22;
  const XQ xq = int8 ? quantize_q8_0(x, m, cols) : XQ{};
#ifdef NANOSERVE_KTILES
  if (int8) {
    at::parallel_for(0, (rows + KTILE_ROWS - 1) / KTILE_ROWS, 1, [&](int64_t t0, int64_t t1) {
      in_row_groups<4>(m, [&](int64_t r0, auto mr) {
        tiles_q5_0<decltype(mr)::value>(xq, r0, w, rows, cols, y + r0 * ldy, ldy, t0, t1);
      });
    });
    return;
  }
#endif
  at::parallel_for(0, rows, 16, [&](int64_t n0, int64_t n1) {
    std::vector<uint8_t> row(row_bytes);
    for (int64_t n = n0; n < n1; ++n) {
      q5t_row(w, cols, n, row.data());
      if (int8)
        rows_q8_portable<Q5_0>(xq, m, row.data(), cols, row_bytes, y + n, ldy, 0, 1);
      else
        rows_f32_portable<Q5_0>(x, m, row.data(), cols, row_bytes, y + n, ldy, 0, 1);
    }
  });
}

template <int64_t KIND>
void matmul_kind(const float* x, int64_t m, const uint8_t* w, int64_t rows, int64_t cols, float* y, int64_t ldy,
                 bool int8) {
  const int64_t row_bytes = cols / kind_values(KIND) * kind_bytes(KIND), grain = 16;
  if (int8) {
    const XQ xq = KIND >= Q4_K ? quantize_q8_k(x, m, cols) : quantize_q8_0(x, m, cols);
#ifdef NANOSERVE_KTILES
    if (m >= TILE_MIN_ROWS) {
      const int64_t tiles = (rows + KTILE - 1) / KTILE;
      at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
        std::vector<TileGroup> tg(cols / GROUP);
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t n0 = t * KTILE, live = std::min<int64_t>(KTILE, rows - n0);
          unpack_tile<KIND>(w, rows, cols, row_bytes, n0, tg.data());
          in_row_groups<4>(m, [&](int64_t r0, auto mr) {
            tile_rows<KIND, decltype(mr)::value>(xq, r0, tg.data(), cols, y + r0 * ldy, ldy, n0, live);
          });
        }
      });
      return;
    }
#endif
    at::parallel_for(0, rows, grain, [&](int64_t n0, int64_t n1) {
#ifdef NANOSERVE_KAVX2
      in_row_groups<4>(m, [&](int64_t r0, auto mr) {
        constexpr int MR = decltype(mr)::value;
        if constexpr (KIND >= Q4_K)
          rows_q8_k<KIND, MR>(xq, r0, w, cols, row_bytes, y + r0 * ldy, ldy, n0, n1);
        else
#ifdef NANOSERVE_KVNNI
          rows_q8_0_vnni<KIND, MR>(xq, r0, w, cols, row_bytes, y + r0 * ldy, ldy, n0, n1);
#else
          rows_q8_0<KIND, MR>(xq, r0, w, cols, row_bytes, y + r0 * ldy, ldy, n0, n1);
#endif
      });
#else
      rows_q8_portable<KIND>(xq, m, w, cols, row_bytes, y, ldy, n0, n1);
#endif
    });
    return;
  }
  at::parallel_for(0, rows, grain, [&](int64_t n0, int64_t n1) {
#ifdef NANOSERVE_KAVX2
    in_row_groups<8>(m, [&](int64_t r0, auto mr) {
      rows_f32<KIND, decltype(mr)::value>(x + r0 * cols, w, cols, row_bytes, y + r0 * ldy, ldy, n0, n1);
    });
#else
    rows_f32_portable<KIND>(x, m, w, cols, row_bytes, y, ldy, n0, n1);
#endif
  });
}

}  // namespace

bool is_kq_kind(int64_t kind) { return kind >= Q4_0 && kind <= Q5_0_TILES; }

int64_t kq_stored_rows(int64_t kind, int64_t rows) {
  return kind == Q5_0_TILES ? (rows + KTILE_ROWS - 1) / KTILE_ROWS * KTILE_ROWS : rows;
}

int64_t kq_row_bytes(int64_t kind, int64_t cols) {
  TORCH_CHECK(is_kq_kind(kind), "kind ", kind, " is not one of 7-13 (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q5_0 tiles)");
  TORCH_CHECK(cols > 0 && cols % kind_values(kind) == 0, "a kind ", kind, " weight's columns come in blocks of ",
              kind_values(kind), ", not ", cols);
  return cols / kind_values(kind) * kind_bytes(kind);
}

void kq_matmul(const float* x, int64_t m, const uint8_t* w, int64_t kind, int64_t rows, int64_t cols, float* y,
               int64_t ldy, bool int8) {
  switch (kind) {
    case Q4_0: return matmul_kind<Q4_0>(x, m, w, rows, cols, y, ldy, int8);
    case Q5_0: return matmul_kind<Q5_0>(x, m, w, rows, cols, y, ldy, int8);
    case Q5_1: return matmul_kind<Q5_1>(x, m, w, rows, cols, y, ldy, int8);
    case Q4_K: return matmul_kind<Q4_K>(x, m, w, rows, cols, y, ldy, int8);
    case Q5_K: return matmul_kind<Q5_K>(x, m, w, rows, cols, y, ldy, int8);
    case Q6_K: return matmul_kind<Q6_K>(x, m, w, rows, cols, y, ldy, int8);
    default: return matmul_q5_0_tiles(x, m, w, rows, cols, y, ldy, int8);
  }
}

void kq_row_floats(const uint8_t* row, int64_t kind, int64_t cols, float* out) {
  TORCH_CHECK(kind != Q5_0_TILES, "a tiles matrix's rows are read with kq_row_floats_at");
  switch (kind) {
    case Q4_0: return row_floats<Q4_0>(row, cols, out);
    case Q5_0: return row_floats<Q5_0>(row, cols, out);
    case Q5_1: return row_floats<Q5_1>(row, cols, out);
    case Q4_K: return row_floats<Q4_K>(row, cols, out);
    case Q5_K: return row_floats<Q5_K>(row, cols, out);
    default: return row_floats<Q6_K>(row, cols, out);
  }
}

void kq_row_floats_at(const uint8_t* w, int64_t kind, int64_t cols, int64_t n, float* out) {
  if (kind != Q5_0_TILES) return kq_row_floats(w + n * kq_row_bytes(kind, cols), kind, cols, out);
  std::vector<uint8_t> row(kq_row_bytes(kind, cols));
  q5t_row(w, cols, n, row.data());
  row_floats<Q5_0>(row.data(), cols, out);
}
