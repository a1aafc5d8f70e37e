// gguf_linear: x W^T with W in a GGUF file's own blocks, read where they lie (a memory map of
// the file), or in an interleaved layout of the same bytes (gguf_repack): no widening, the
// file's bytes per weight.
//
// The file's layouts are read one output row at a time, a row being the file's run of blocks
// for it. The activations are quantized to int8 once per call, per 32 inputs for the types
// with blocks of 32 (GGML's Q8_0 form with the block's sum) and per 256 for the K-quants
// (Q8_K: one scale per 256, sums per 16). Each weight block then gives exact integer sums,
// and every float operation after them is the same on every path, in the same order:
//
//   Q4_0, Q5_0, Q8_0   s = sum q x - o sum x (o = 8, 16, 0)     acc = fma(d dx, s, acc)
//   Q4_1, Q5_1         s = sum q x                              acc = fma(d dx, s, acc)
//                                                               acc = fma(m dx, sum x, acc)
//     (8 float lanes, one per 4 inputs of each 32: see the portable path; summed in one tree)
//   IQ4_NL, MXFP4      s = sum q x over the block (q a code's signed level)
//                                                              acc = fma(d dx, s, acc)
//   Q4_K, Q5_K         s = sum_j sc_j sum q x, t = sum_j m_j sum x
//                                    acc = fma(d dx, s, acc) then fma(-(dmin dx), t, acc)
//   Q6_K               s = sum_j sc_j (sum q x - 32 sum x)      acc = fma(d dx, s, acc)
//     (one accumulator per output: a K-quant block's sums, and a table type's, are whole
//     integers, so a layout with 8 rows in the lanes, Q4_Kx8, Q6_Kx8, IQ4_NLx8 or MXFP4x8,
//     gives the same bits as the file's)
//
// The integer sums are exact whatever order adds them, so the portable path (plain C++), the
// AVX2 path (vpmaddubsw / vpmaddwd) and the VNNI path (the x8 layouts on vpdpbusd, with
// AVX512-VNNI or AVX-VNNI) give the same bits,
// and a row's result never depends on the other rows of the call (batch invariance): work
// is split over output rows only. The activations' quantization is one arithmetic, in plain
// C++ for the portable path and in AVX2 vectors for the others (quantize_x). Float
// contraction is off in this file: a compiler fusing a multiply into a later add would make a
// path's rounding its own.
//
// gguf_rows: the same blocks dequantized, rows picked by index (an embedding lookup on the
// file's codes), with gguf's own arithmetic (so the floats are gguf's, bit for bit).
#include "common.h"

#include <algorithm>
#include <cmath>
#include <vector>

#pragma GCC optimize("fp-contract=off")

namespace {

// GGML's type numbers (ggml.h), as GGUF stores them.
enum : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ4_NL = 20, kIQ4_XS = 23, kMXFP4 = 39
};
// kvserve's own: a type's blocks with 8 rows interleaved (gguf_repack), numbered 1000 + the
// GGML type. A part of one is [rows / 8, blocks * 8 * block bytes].
enum : int64_t {
  kX8 = 1000, kQ4_Kx8 = kX8 + kQ4_K, kQ6_Kx8 = kX8 + kQ6_K, kIQ4_NLx8 = kX8 + kIQ4_NL,
  kMXFP4x8 = kX8 + kMXFP4
};

// The K-quants (and IQ4_XS, blocks of 256 too) keep one accumulator per output; the types
// with blocks of 32, 8 lanes, except the table types (one_acc).
constexpr bool is_kquant(int64_t type) {
  return type == kQ4_K || type == kQ5_K || type == kQ6_K || type == kIQ4_XS;
}

// The types with blocks of 32 whose 4-bit codes (Q4_0's nibbles) index a table of 16 signed
// levels: IQ4_NL (an f16 scale first) and MXFP4 (an E8M0 exponent first).
constexpr bool is_table4(int64_t type) { return type == kIQ4_NL || type == kMXFP4; }

// The table types keep one accumulator per output, as the K-quants do, although their
// blocks are of 32: their interleaved layouts (IQ4_NLx8, MXFP4x8: 8 or 16 rows in a
// register's lanes) then make one float step a block and row, against the 8 of the lanes'
// form, whose float steps held an MXFP4 prefill to ~50 G multiply-adds a second on a Zen 4
// (the int32 sums ran ~4x faster).
constexpr bool one_acc(int64_t type) { return is_kquant(type) || is_table4(type); }

// A table type's levels made unsigned for vpmaddubsw / vpdpbusd: level + its offset (MXFP4:
// 12, so 0 .. 24; IQ4_NL: 127, so 0 .. 240); the sum of the signed levels is then the sum of
// these less the offset times the block's sum of x.
template <int64_t Type>
constexpr int kTableOffset = Type == kMXFP4 ? 12 : 127;
// A table type's scale bytes, before its codes in a block and for each row in an x8 group:
// MXFP4's exponent, IQ4_NL's float16.
template <int64_t Type>
constexpr int kScaleBytes = Type == kMXFP4 ? 1 : 2;

// IQ4_NL's and IQ4_XS's 16 levels (GGML's kvalues_iq4nl): a 4-bit code indexes them.
alignas(16) constexpr int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

// MXFP4's 16 levels (GGML's kvalues_mxfp4): FP4 E2M1's values doubled, so that they are
// integers, and the block's scale halved to match (e8m0_half).
alignas(16) constexpr int8_t kMXFP4Levels[16] = {0, 1, 2, 3, 4, 6, 8, 12,
                                                 0, -1, -2, -3, -4, -6, -8, -12};

template <int64_t Type>
constexpr const int8_t* table4() {
  return Type == kMXFP4 ? kMXFP4Levels : kIQ4Levels;
}

// An MXFP4 block's scale, 2^(e - 128) (the E8M0 exponent's 2^(e - 127), halved for the
// doubled levels), built from its bits as GGML's ggml_e8m0_to_fp32_half and gguf's numpy code
// do: e < 2 gives a subnormal float (2^-128, 2^-127), which an exponent field cannot hold.
// Exact: every e gives a finite power of two.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

// IQ4_XS block (136 bytes): d (float16), scales_h (uint16: 2 high bits of each sub-block's
// scale), scales_l (4 bytes: 4 low bits each), 128 bytes of codes; sub-block j's scale is
// (its 6 bits) - 32, its codes are bytes 8 + 16 j .. + 15 (low nibbles: inputs 32 j + i,
// high: 32 j + 16 + i).
inline int32_t iq4xs_scale(const uint8_t* w, int j) {
  const uint32_t bits = static_cast<uint32_t>(w[2]) | static_cast<uint32_t>(w[3]) << 8;
  const uint32_t high = bits >> (2 * j);
  return static_cast<int32_t>(((w[4 + j / 2] >> (4 * (j % 2))) & 15) | ((high & 3) << 4)) - 32;
}

struct TypeInfo {
  int64_t block;      // weights per block
  int64_t bytes;      // bytes per block (of a part row: 8 rows' blocks for the x8 layouts)
  int64_t group = 1;  // output rows per part row
};

bool type_info(int64_t type, TypeInfo* info) {
  switch (type) {
    case kQ4_0: *info = {32, 18}; return true;
    case kQ4_1: *info = {32, 20}; return true;
    case kQ5_0: *info = {32, 22}; return true;
    case kQ5_1: *info = {32, 24}; return true;
    case kQ8_0: *info = {32, 34}; return true;
    case kQ4_K: *info = {256, 144}; return true;
    case kQ5_K: *info = {256, 176}; return true;
    case kQ6_K: *info = {256, 210}; return true;
    case kIQ4_NL: *info = {32, 18}; return true;
    case kIQ4_XS: *info = {256, 136}; return true;
    case kMXFP4: *info = {32, 17}; return true;
    case kQ4_Kx8: *info = {256, 8 * 144, 8}; return true;
    case kQ6_Kx8: *info = {256, 8 * 210, 8}; return true;
    case kIQ4_NLx8: *info = {32, 8 * 18, 8}; return true;
    case kMXFP4x8: *info = {32, 8 * 17, 8}; return true;
    default: return false;
  }
}

inline float f16(const uint8_t* p) {  // exact, however converted
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A block of 32's scale d (Q4_1/Q5_1: its first field; the minimum follows it).
template <int64_t Type>
inline float scale32(const uint8_t* w) {
  if constexpr (Type == kMXFP4) return e8m0_half(w[0]);
  return f16(w);
}

// Where a block of 32's codes start: after its scale (1 byte for MXFP4's exponent, an f16
// for the others), Q4_1/Q5_1's minimum (f16) and Q5_0/Q5_1's 32 high bits.
template <int64_t Type>
constexpr int codes32_at() {
  if constexpr (Type == kMXFP4) return 1;
  const bool hasmin = Type == kQ4_1 || Type == kQ5_1, five = Type == kQ5_0 || Type == kQ5_1;
  return (hasmin ? 4 : 2) + (five ? 4 : 0);
}

// The 6-bit scales and minimums of a Q4_K/Q5_K block's 8 sub-blocks, from its 12 bytes, as
// four words: scales 0-3, scales 4-7, minimums 0-3, minimums 4-7 (a byte each).
// Four bytes at a time: sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63 for j < 4; for j >= 4 the
// low and high nibbles of s[j + 4] below the top two bits of s[j - 4] and s[j].
inline void k_scale_words(const uint8_t* s, uint32_t* out) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  out[0] = u[0] & 0x3f3f3f3fu;
  out[1] = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u);
  out[2] = u[1] & 0x3f3f3f3fu;
  out[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u);
}

inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  uint32_t words[4];
  k_scale_words(s, words);
  std::memcpy(sc, words, 8);
  std::memcpy(mn, words + 2, 8);
}

// The activations, quantized per row: q [M, K] int8, x ~ q * d per block of `block` inputs
// (32 or 256), with sums of q: per block of 32, its 8 lanes' (lane l: inputs 4l .. 4l + 3);
// per block of 256, its 16 runs of 16 (int16, as the AVX2 path loads them).
struct QuantX {
  // blocks: K / block, kept so that scale() multiplies: a division there (a runtime
  // divisor) cost a 64-bit idiv every block of 32 in the row kernels, most of an MXFP4 or
  // Q8_0 decode GEMV's time on a Zen 4
  int64_t block = 0, K = 0, blocks = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> lanes;  // block 32: [M, K / 32, 8]
  std::vector<int32_t> sums;   // block 32: [M, K / 32], each block's sum (of its lanes')
  std::vector<int16_t> runs;   // block 256: [M, K / 256, 16]
  // block 256: [M, K / 256, 4], word k the sums of sub-blocks (of 32) 2k and 2k + 1 as int16
  // (low, high): what vpmaddwd takes against a row's minimums 2k and 2k + 1
  std::vector<int32_t> sub_pairs;

  const int8_t* row(int64_t m) const { return q.data() + m * K; }
  float scale(int64_t m, int64_t b) const { return d[m * blocks + b]; }
  const int32_t* lane_sums(int64_t m, int64_t b) const {
    return lanes.data() + (m * (K / 32) + b) * 8;
  }
  int32_t block_sum(int64_t m, int64_t b) const { return sums[m * blocks + b]; }
  const int16_t* run_sums(int64_t m, int64_t b) const {
    return runs.data() + (m * (K / 256) + b) * 16;
  }
  const int32_t* pairs(int64_t m, int64_t b) const {
    return sub_pairs.data() + (m * (K / 256) + b) * 4;
  }
};

// Sizes `out` for M rows of K inputs in blocks of `block`.
void quantize_x_shape(int64_t M, int64_t K, int64_t block, QuantX& out) {
  out.block = block;
  out.K = K;
  out.blocks = K / block;
  out.q.resize(M * K);
  out.d.resize(M * K / block);
  if (block == 32) {
    out.lanes.resize(M * K / 4);
    out.sums.resize(M * K / 32);
  } else {
    out.runs.resize(M * K / 16);
    out.sub_pairs.resize(M * K / 64);
  }
}

// A block of 256's sub-block pair sums (QuantX::sub_pairs) from its 16 run sums.
inline void quantize_x_pairs(const int16_t* run, int32_t* pairs) {
  for (int k = 0; k < 4; ++k) {  // sub-block j's sum: runs 2j and 2j + 1
    const auto lo = static_cast<uint16_t>(run[4 * k] + run[4 * k + 1]);
    const auto hi = static_cast<uint16_t>(run[4 * k + 2] + run[4 * k + 3]);
    pairs[k] = static_cast<int32_t>(lo | static_cast<uint32_t>(hi) << 16);
  }
}

// The reference quantization, in plain C++ (the portable path's): amax, q = round to nearest
// even of x * (127 / amax) clamped to +-127, d = amax / 127; every path's gives these bits.
template <typename T>
void quantize_x_portable(const T* x, int64_t M, int64_t K, int64_t block, QuantX& out) {
  quantize_x_shape(M, K, block, out);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> v(block);
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < K / block; ++b) {
        float amax = 0.f;
        for (int64_t i = 0; i < block; ++i) {
          v[i] = static_cast<float>(x[m * K + b * block + i]);
          amax = std::max(amax, std::fabs(v[i]));
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* q = out.q.data() + m * K + b * block;
        for (int64_t i = 0; i < block; ++i) {
          const float r = std::nearbyint(v[i] * inv);  // to nearest even, as cvtps2dq
          q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
        }
        out.d[m * (K / block) + b] = amax / 127.f;
        const int64_t per = block == 32 ? 4 : 16;
        for (int64_t g = 0; g < block / per; ++g) {
          int32_t total = 0;
          for (int64_t i = 0; i < per; ++i) total += q[g * per + i];
          if (block == 32)
            out.lanes[(m * (K / 32) + b) * 8 + g] = total;
          else
            out.runs[(m * (K / 256) + b) * 16 + g] = static_cast<int16_t>(total);
        }
        if (block == 256)
          quantize_x_pairs(out.runs.data() + (m * (K / 256) + b) * 16,
                           out.sub_pairs.data() + (m * (K / 256) + b) * 4);
      }
    }
  });
}

// ---------------------------------------------------------------------- portable path
//
// A dot product is 8 float lanes, each accumulated with one fma per block and term from the
// block's integer sums of that lane, then summed in one tree (sum_lanes). Lane l holds, of
// every run of 32 inputs, inputs 4l .. 4l + 3 (each times its scale, for the K-quants): the
// int32 lanes vpmaddwd leaves. The K-quants' correction terms are lane-wise too: Q4_K/Q5_K's
// lane l is sub-block l's minimum times its sum of x, Q6_K's the scales of runs of 16 2l
// and 2l + 1 times their sums of x. The AVX2 path computes the same integers in the same
// lanes, so the same float operations follow.

inline float sum_lanes(const float* a) {  // ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// Code i (0..31) of a block of 32 (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 as stored, Q8_0 signed; IQ4_NL
// and MXFP4 the signed level their code indexes).
template <int64_t Type>
inline int32_t code32(const uint8_t* w, int i) {
  if constexpr (Type == kQ8_0) return static_cast<int8_t>(w[2 + i]);
  const bool hasmin = Type == kQ4_1 || Type == kQ5_1, five = Type == kQ5_0 || Type == kQ5_1;
  const uint8_t* qs = w + codes32_at<Type>();
  int32_t q = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
  if constexpr (five) q |= ((u32(w + (hasmin ? 4 : 2)) >> i) & 1) << 4;
  if constexpr (is_table4(Type)) return table4<Type>()[q];  // Q4_0's nibble: a level's index
  return q;
}

// Code e (0..255) of a K-quant block.
template <int64_t Type>
inline int32_t code256(const uint8_t* w, int e) {
  if constexpr (Type == kQ6_K) {
    const int h = e / 128, g = (e % 128) / 32, l = e % 32;
    return ((w[h * 64 + (g % 2) * 32 + l] >> (4 * (g / 2))) & 15) |
           (((w[128 + h * 32 + l] >> (2 * g)) & 3) << 4);
  } else {
    const int j = e / 32, i = e % 32;
    const uint8_t* qs = w + 16 + (Type == kQ5_K ? 32 : 0);
    int32_t q = (qs[(j / 2) * 32 + i] >> (4 * (j % 2))) & 15;
    if constexpr (Type == kQ5_K) q |= ((w[16 + i] >> j) & 1) << 4;
    return q;
  }
}

// Block `b` of one weight row (a type with blocks of 32) against activation row m: its terms
// added to the lanes.
template <int64_t Type>
inline void block_lanes(const uint8_t* w, const QuantX& x, int64_t m, int64_t b, float* acc) {
  int32_t s[8] = {0};
  const float dx = x.scale(m, b);
  const int8_t* xb = x.row(m) + b * 32;
  const int32_t* xs = x.lane_sums(m, b);
  for (int l = 0; l < 8; ++l) {
    for (int i = 4 * l; i < 4 * l + 4; ++i) s[l] += code32<Type>(w, i) * xb[i];
    if constexpr (Type == kQ4_0) s[l] -= 8 * xs[l];
    if constexpr (Type == kQ5_0) s[l] -= 16 * xs[l];
  }
  const float dd = scale32<Type>(w) * dx;
  for (int l = 0; l < 8; ++l) acc[l] = std::fma(dd, static_cast<float>(s[l]), acc[l]);
  if constexpr (Type == kQ4_1 || Type == kQ5_1) {
    const float md = f16(w + 2) * dx;
    for (int l = 0; l < 8; ++l) acc[l] = std::fma(md, static_cast<float>(xs[l]), acc[l]);
  }
}

// A table type's block's exact integer sum against activation row m's block b (one_acc).
template <int64_t Type>
inline int32_t table4_sum(const uint8_t* w, const QuantX& x, int64_t m, int64_t b) {
  const int8_t* xb = x.row(m) + b * 32;
  int32_t s = 0;
  for (int i = 0; i < 32; ++i) s += code32<Type>(w, i) * xb[i];
  return s;
}

// A K-quant block's exact integer sums against activation row m's block b: s (codes times
// scales times x; Q6_K's less 32 times each scale's sum of x) and t (Q4_K/Q5_K: minimums
// times their sub-blocks' sums of x).
template <int64_t Type>
inline void kquant_sums(const uint8_t* w, const QuantX& x, int64_t m, int64_t b, int32_t* s,
                        int32_t* t) {
  const int8_t* xb = x.row(m) + b * 256;
  const int16_t* runs = x.run_sums(m, b);
  *s = *t = 0;
  if constexpr (Type == kIQ4_XS) {
    for (int j = 0; j < 8; ++j) {
      int32_t sum = 0;
      for (int i = 0; i < 16; ++i) {
        const uint8_t c = w[8 + 16 * j + i];
        sum += kIQ4Levels[c & 15] * xb[32 * j + i] + kIQ4Levels[c >> 4] * xb[32 * j + 16 + i];
      }
      *s += iq4xs_scale(w, j) * sum;
    }
  } else if constexpr (Type == kQ6_K) {
    const auto* sc6 = reinterpret_cast<const int8_t*>(w + 192);
    for (int e = 0; e < 256; ++e) *s += sc6[e / 16] * code256<Type>(w, e) * xb[e];
    for (int g = 0; g < 16; ++g) *s -= 32 * sc6[g] * runs[g];
  } else {
    uint8_t sc[8], mn[8];
    k_scales(w + 4, sc, mn);
    for (int e = 0; e < 256; ++e) *s += sc[e / 32] * code256<Type>(w, e) * xb[e];
    for (int j = 0; j < 8; ++j) *t += mn[j] * (runs[2 * j] + runs[2 * j + 1]);
  }
}

// The float steps of a K-quant block, the same on every path and layout: one accumulator
// per output, a fused multiply-add per term.
inline float kquant_acc(float acc, float d, float dmin, float dx, int32_t s, int32_t t,
                        bool has_min) {
  acc = std::fma(d * dx, static_cast<float>(s), acc);
  if (has_min) acc = std::fma(-(dmin * dx), static_cast<float>(t), acc);
  return acc;
}

template <int64_t Type>
void rows_portable(const uint8_t* w, int64_t blocks, int64_t bytes, const QuantX& x, int64_t m0,
                   int nr, float* out) {
  for (int r = 0; r < nr; ++r) {
    if constexpr (is_table4(Type)) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b)
        acc = kquant_acc(acc, scale32<Type>(w + b * bytes), 0.f, x.scale(m0 + r, b),
                         table4_sum<Type>(w + b * bytes, x, m0 + r, b), 0, false);
      out[r] = acc;
    } else if constexpr (is_kquant(Type)) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* wb = w + b * bytes;
        int32_t s, t;
        kquant_sums<Type>(wb, x, m0 + r, b, &s, &t);
        const float dx = x.scale(m0 + r, b);
        acc = Type == kQ6_K     ? kquant_acc(acc, f16(wb + 208), 0.f, dx, s, t, false)
              : Type == kIQ4_XS ? kquant_acc(acc, f16(wb), 0.f, dx, s, t, false)
                                : kquant_acc(acc, f16(wb), f16(wb + 2), dx, s, t, true);
      }
      out[r] = acc;
    } else {
      float acc[8] = {0.f};
      for (int64_t b = 0; b < blocks; ++b) block_lanes<Type>(w + b * bytes, x, m0 + r, b, acc);
      out[r] = sum_lanes(acc);
    }
  }
}

// ---------------------------------------------------------------------- 8 rows interleaved
//
// Q4_Kx8 holds 8 rows' Q4_K blocks b side by side in 1152 bytes (8 x 144: the file's bytes),
// laid out for a kernel whose 8 lanes are the 8 rows:
//   [0, 16)      d of rows 0..7 (float16)        [16, 32)   dmin of rows 0..7
//   [32, 128)    the 12 scale bytes as three 32-byte runs of words: word w of row r at
//                32 + 32 w + 4 r (the words k_scale_words reads)
//   [128, 1152)  32 chunks of 32 bytes, chunk 8 k + c: bytes 4 r .. 4 r + 3 are row r's
//                qs bytes 32 k + 4 c .. + 3 (low nibbles: sub-block 2 k, inputs 4 c .. 4 c + 3;
//                high nibbles: sub-block 2 k + 1)
// Q6_Kx8 holds 8 rows' Q6_K blocks in 1680 bytes (8 x 210):
//   [0, 16)      d of rows 0..7 (float16)
//   [16, 144)    the 16 scales, scale j of row r at 16 + 8 j + r
//   [144, 1680)  16 triples of 32-byte chunks, triple 8 h + c at 144 + 96 (8 h + c): row r's
//                bytes 4 r .. 4 r + 3 of ql at 64 h + 4 c (low nibbles: inputs 128 h + 4 c ..,
//                high nibbles: 128 h + 64 + 4 c ..), of ql at 64 h + 32 + 4 c (inputs
//                128 h + 32 + 4 c .., 128 h + 96 + 4 c ..), then of qh at 128 + 32 h + 4 c
//                (their top two bits: bits 0-1, 2-3, 4-5, 6-7 for the four runs of 32 in
//                that order)
// MXFP4x8 and IQ4_NLx8 hold 8 rows' blocks of 32 in 136 bytes (8 x 17) or 144 (8 x 18),
// with H = kScaleBytes (1: MXFP4's exponent; 2: IQ4_NL's float16 scale):
//   [0, 8 H)     the scales of rows 0..7
//   [8 H, ..)    4 chunks of 32 bytes, chunk c at 8 H + 32 c: bytes 4 r .. 4 r + 3 are row
//                r's code bytes 4 c .. 4 c + 3 (low nibbles: inputs 4 c .. 4 c + 3; high
//                nibbles: inputs 16 + 4 c .. 16 + 4 c + 3)
// Their arithmetic is the file's type's (kquant_sums or table4_sum, kquant_acc): the same
// bits as the file's blocks.
template <int64_t Type>
constexpr int64_t kX8Bytes =
    8 * (Type == kQ4_K ? 144 : Type == kMXFP4 ? 17 : Type == kIQ4_NL ? 18 : 210);

// The layouts above as runs: f(offset in row r's block, offset in the group, bytes), for
// every run of row r. Packing and unpacking both follow them, so they cannot disagree.
template <int64_t Type, typename F>
inline void x8_runs(int r, F f) {
  if constexpr (is_table4(Type)) {
    constexpr int h = kScaleBytes<Type>;
    f(0, h * r, h);  // the scale
    for (int c = 0; c < 4; ++c) f(h + 4 * c, 8 * h + 32 * c + 4 * r, 4);
  } else if constexpr (Type == kQ4_K) {
    f(0, 2 * r, 2);       // d
    f(2, 16 + 2 * r, 2);  // dmin
    for (int w = 0; w < 3; ++w) f(4 + 4 * w, 32 + 32 * w + 4 * r, 4);
    for (int k = 0; k < 4; ++k)
      for (int c = 0; c < 8; ++c) f(16 + 32 * k + 4 * c, 128 + 32 * (8 * k + c) + 4 * r, 4);
  } else {
    f(208, 2 * r, 2);  // d
    for (int j = 0; j < 16; ++j) f(192 + j, 16 + 8 * j + r, 1);
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 8; ++c) {
        const int t = 144 + 96 * (8 * h + c) + 4 * r;
        f(64 * h + 4 * c, t, 4);
        f(64 * h + 32 + 4 * c, t + 32, 4);
        f(128 + 32 * h + 4 * c, t + 64, 4);
      }
  }
}

// Row r of block-group g, as the file's block it was made from.
template <int64_t Type>
inline void x8_block(const uint8_t* g, int r, uint8_t* out) {
  x8_runs<Type>(r, [&](int blk, int grp, int n) { std::memcpy(out + blk, g + grp, n); });
}

template <int64_t Type>
inline void x8_pack(const uint8_t* const* rows, uint8_t* g) {  // 8 blocks -> a group
  for (int r = 0; r < 8; ++r)
    x8_runs<Type>(r, [&](int blk, int grp, int n) { std::memcpy(g + grp, rows[r] + blk, n); });
}

// 8 rows (one group run, `blocks` groups) against activation rows m0 .. m0 + nr - 1:
// out[8 r + i] for activation row m0 + r and weight row i.
template <int64_t Type>
void x8_portable(const uint8_t* g, int64_t blocks, const QuantX& x, int64_t m0, int nr,
                 float* out) {
  uint8_t blk[210];
  for (int r = 0; r < nr; ++r)
    for (int i = 0; i < 8; ++i) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        x8_block<Type>(g + b * kX8Bytes<Type>, i, blk);
        if constexpr (is_table4(Type)) {
          acc = kquant_acc(acc, scale32<Type>(blk), 0.f, x.scale(m0 + r, b),
                           table4_sum<Type>(blk, x, m0 + r, b), 0, false);
        } else {
          int32_t s, t;
          kquant_sums<Type>(blk, x, m0 + r, b, &s, &t);
          acc = Type == kQ6_K
                    ? kquant_acc(acc, f16(blk + 208), 0.f, x.scale(m0 + r, b), s, 0, false)
                    : kquant_acc(acc, f16(blk), f16(blk + 2), x.scale(m0 + r, b), s, t, true);
        }
      }
      out[8 * r + i] = acc;
    }
}

// ---------------------------------------------------------------------- AVX2 path

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kHasAvx2Path = true;
constexpr int kRows = 4;  // activation rows per pass over a weight row
// How far ahead of the block being read its row is prefetched, in bytes. A decode step
// streams each matrix from memory once; on a Zen 3 (AVX2, 2 threads) a Q4_K matrix read at
// 14 GB/s with no prefetch, ~10 GB/s with one line of every block prefetched 8 blocks ahead
// (the lines between were missed), and 17-18 GB/s with every line 2-4 KiB ahead, against
// 18-20 GB/s for a plain sum of the same bytes.
constexpr int64_t kAhead = 4096;

// 32 bits -> 32 bytes, byte i = 0xFF where bit i is set.
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                         0x0303030303030303));
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// A table of 16 levels (kIQ4Levels by default) in both 128-bit lanes: a vpshufb table from
// 4-bit codes to levels.
template <int64_t Type = kIQ4_NL>
inline __m256i iq4_levels() {
  return _mm256_broadcastsi128_si256(
      _mm_load_si128(reinterpret_cast<const __m128i*>(table4<Type>())));
}

// Int16 word j of `words` (the same 8 words in both 128-bit lanes) in every int16 lane of
// out[j]: each run's scale, for vpmaddwd.
inline void broadcast_words(__m256i words, __m256i* out) {
  for (int j = 0; j < 8; ++j)
    out[j] = _mm256_shuffle_epi8(words, _mm256_set1_epi16(
        static_cast<int16_t>((2 * j) | ((2 * j + 1) << 8))));
}

// The 8 runs of 32 of a K-quant block: codes q (unsigned) times activations a, each run's
// int16 pair sums times its scales' int16 lanes (vpmaddwd), added up in 8 int32 lanes.
inline __m256i scaled_runs(const __m256i* q, const __m256i* scales, const int8_t* a) {
  __m256i s = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j)
    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], load32(a + 32 * j)),
                                              scales[j]));
  return s;
}

// Keeps accumulators in registers, each added to in program order. Without it GCC treats the
// intrinsics' integer adds as plain vector arithmetic: it reassociated a sub-block's 8 chunks
// into a tree over products stored on the stack, or spilled an accumulator and carried it
// through memory. At 512 rows, 2 threads, on a Zen 3, that cost the Q4_Kx8 kernel ~20% (the
// same integers either way: the results do not change).
template <int N>
inline void in_registers(__m256i (&v)[N]) {
#if defined(__AVX512VL__)
  for (int i = 0; i < N; ++i) asm("" : "+v"(v[i]));  // any of the 32 registers
#else
  for (int i = 0; i < N; ++i) asm("" : "+x"(v[i]));
#endif
}

// vpdpbusd: unsigned bytes times signed bytes, each 4 products summed into an int32 lane,
// with no saturation (the "s" form saturates). Exact, like vpmaddubsw's pair sums where those
// cannot saturate: the x8 kernels' VNNI form gives the AVX2 form's integers, in fewer steps
// (one instruction for vpmaddubsw + vpaddw, and int32 sums over a whole sub-block).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kHasVnniPath = true;
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(acc, u, s);
}
#elif defined(__AVXVNNI__)
constexpr bool kHasVnniPath = true;
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(acc, u, s);
}
#else
constexpr bool kHasVnniPath = false;
__m256i dpbusd(__m256i acc, __m256i u, __m256i s);  // only in VNNI kernels, not built here
#endif

inline int32_t hsum_i32(__m256i v) {  // exact: any order gives the same integer
  __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xb1));
  return _mm_cvtsi128_si32(a);
}

inline float sum_lanes8(__m256 v) {
  alignas(32) float a[8];
  _mm256_store_ps(a, v);
  return sum_lanes(a);
}

// quantize_x_portable's arithmetic 8 lanes at a time, so its bits: the same float products,
// the same clamp to +-127 (max_ps returns its second operand where the first is a NaN, as
// std::max(-127.f, NaN) returns -127; +-inf, from a block with a subnormal amax, clamps to
// +-127 as it does there), cvtps2dq's rounding to nearest even (nearbyint's in the default
// mode), and exact integer sums. The amax is taken with max_ps(|v|, amax), which like
// std::max skips a NaN.
// It was ~10% of a 500-token prefill's time in the scalar form (Zen 5, 1.5B Q4_K_M).
template <typename T>
void quantize_x_avx2(const T* x, int64_t M, int64_t K, int64_t block, QuantX& out) {
  quantize_x_shape(M, K, block, out);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    alignas(32) int32_t fours[64];  // sums of 4 consecutive codes, a block's worth
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < K / block; ++b) {
        const T* v = x + m * K + b * block;
        __m256 mx = _mm256_setzero_ps();
        for (int64_t i = 0; i < block; i += 8)
          mx = _mm256_max_ps(_mm256_and_ps(kvs::widen8(v + i), abs_mask), mx);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float inv_s = amax > 0.f ? 127.f / amax : 0.f;
        const __m256 inv = _mm256_set1_ps(inv_s);
        int8_t* q = out.q.data() + m * K + b * block;
        for (int64_t i = 0; i < block; i += 32) {
          __m256i c[4];
          for (int j = 0; j < 4; ++j)  // clamped before rounding: the bounds are integers
            c[j] = _mm256_cvtps_epi32(_mm256_min_ps(
                _mm256_max_ps(_mm256_mul_ps(kvs::widen8(v + i + 8 * j), inv), lo), hi));
          // packs interleave the 128-bit lanes: 4-byte runs of c0, c1, c2, c3, then their
          // second halves; the permute puts the 8 runs back in order
          const __m256i bytes = _mm256_permutevar8x32_epi32(
              _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])),
              order);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), bytes);
          _mm256_store_si256(reinterpret_cast<__m256i*>(fours + i / 4),
                             _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, bytes), ones16));
        }
        out.d[m * (K / block) + b] = amax / 127.f;
        if (block == 32) {
          std::memcpy(out.lanes.data() + (m * (K / 32) + b) * 8, fours, 8 * sizeof(int32_t));
        } else {
          int16_t* run = out.runs.data() + (m * (K / 256) + b) * 16;
          for (int g = 0; g < 16; ++g)
            run[g] = static_cast<int16_t>(fours[4 * g] + fours[4 * g + 1] + fours[4 * g + 2] +
                                          fours[4 * g + 3]);
          quantize_x_pairs(run, out.sub_pairs.data() + (m * (K / 256) + b) * 4);
        }
      }
    }
  });
}

// One weight row against NR activation rows (m0 .. m0 + NR - 1): the portable path's lanes
// and float operations, from vpmaddubsw (unsigned codes x signed activations, pairs summed in
// int16: at most 2 * 63 * 127) and vpmaddwd (pairs of those times the scales, in int32).
template <int64_t Type, int NR>
void row_dot_avx2(const uint8_t* w, int64_t blocks, int64_t bytes, const QuantX& x, int64_t m0,
                  float* out) {
  __m256 acc[NR];  // the lanes of the types with blocks of 32
  float kacc[NR];  // one accumulator per output (one_acc: the K-quants, the table types)
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps(), kacc[r] = 0.f;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  // Every cache line kAhead bytes ahead of the block read is prefetched, once. The row's
  // successor in the file (the next call's row, most often) is prefetched by its tail.
  const uint8_t* ahead = w + kAhead;
  for (int64_t b = 0; b < blocks; ++b, w += bytes) {
    for (; ahead < w + bytes + kAhead; ahead += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    if constexpr (!is_kquant(Type)) {
      const float d = scale32<Type>(w);
      __m256i q;  // the block's 32 codes as bytes (Q8_0, IQ4_NL, MXFP4: signed)
      if constexpr (Type == kQ8_0) {
        q = load32(w + 2);
      } else {  // Q4_0's nibbles (IQ4_NL, MXFP4: indices of their levels)
        const bool hasmin = Type == kQ4_1 || Type == kQ5_1;
        const bool five = Type == kQ5_0 || Type == kQ5_1;
        const __m128i qs = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(w + codes32_at<Type>()));
        q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), low);
        if constexpr (five)
          q = _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes(u32(w + (hasmin ? 4 : 2))),
                                                  _mm256_set1_epi8(16)));
        if constexpr (is_table4(Type)) q = _mm256_shuffle_epi8(iq4_levels<Type>(), q);
      }
      constexpr bool is_signed = Type == kQ8_0 || is_table4(Type);
      __m256i qa = q;  // signed codes: |q|, x taking q's sign
      if constexpr (is_signed) qa = _mm256_abs_epi8(q);
      for (int r = 0; r < NR; ++r) {
        const int64_t m = m0 + r;
        __m256i a = load32(x.row(m) + b * 32);
        if constexpr (is_signed) a = _mm256_sign_epi8(a, q);
        __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(qa, a), ones);
        const __m256i xs = load32(x.lane_sums(m, b));
        if constexpr (Type == kQ4_0) s = _mm256_sub_epi32(s, _mm256_slli_epi32(xs, 3));
        if constexpr (Type == kQ5_0) s = _mm256_sub_epi32(s, _mm256_slli_epi32(xs, 4));
        const float dx = x.scale(m, b);
        if constexpr (one_acc(Type)) {  // the table types
          kacc[r] = kquant_acc(kacc[r], d, 0.f, dx, hsum_i32(s), 0, false);
          continue;
        }
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(s), acc[r]);
        if constexpr (Type == kQ4_1 || Type == kQ5_1)
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f16(w + 2) * dx), _mm256_cvtepi32_ps(xs),
                                   acc[r]);
      }
    } else if constexpr (Type == kIQ4_XS) {
      // 32 bytes of codes hold sub-blocks 2c and 2c + 1: their low nibbles (inputs 0..15 of
      // each) in the low nibbles, inputs 16..31 in the high ones; the lanes' halves are
      // exchanged so that one register holds one sub-block's 32 inputs in order, then the
      // codes become their signed levels (vpshufb) and pair with x as Q8_0's codes do.
      __m256i q[8];
      for (int c = 0; c < 4; ++c) {
        const __m256i p = load32(w + 8 + 32 * c);
        const __m256i lo = _mm256_and_si256(p, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
        q[2 * c] = _mm256_shuffle_epi8(iq4_levels(), _mm256_permute2x128_si256(lo, hi, 0x20));
        q[2 * c + 1] = _mm256_shuffle_epi8(iq4_levels(),
                                           _mm256_permute2x128_si256(lo, hi, 0x31));
      }
      // the 8 scales as int16, iq4xs_scale in registers: the low nibbles of bytes 4..7 in
      // order, the 2-bit fields of bytes 2..3 shifted to the top of each lane by a multiply
      // (vpmullw keeps the low 16 bits) and back down
      const __m128i l4 = _mm_cvtsi32_si128(static_cast<int>(u32(w + 4)));
      const __m128i nib = _mm_cvtepu8_epi16(_mm_unpacklo_epi8(
          _mm_and_si128(l4, _mm_set1_epi8(15)), _mm_and_si128(_mm_srli_epi16(l4, 4),
                                                              _mm_set1_epi8(15))));
      const __m128i h2 = _mm_srli_epi16(
          _mm_mullo_epi16(_mm_set1_epi16(static_cast<int16_t>(w[2] | w[3] << 8)),
                          _mm_setr_epi16(1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 1 << 4,
                                         1 << 2, 1)),
          14);
      __m256i scale[8];  // each sub-block's scale in every int16 lane
      broadcast_words(_mm256_broadcastsi128_si256(_mm_sub_epi16(
                          _mm_or_si128(nib, _mm_slli_epi16(h2, 4)), _mm_set1_epi16(32))),
                      scale);
      __m256i qa[8];  // |level|: x takes the level's sign
      for (int j = 0; j < 8; ++j) qa[j] = _mm256_abs_epi8(q[j]);
      const float d = f16(w);
      for (int r = 0; r < NR; ++r) {
        const int64_t m = m0 + r;
        const int8_t* a = x.row(m) + b * 256;
        __m256i s = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j)  // pairs at most 2 * 127 * 127: no int16 saturation
          s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(
              qa[j], _mm256_sign_epi8(load32(a + 32 * j), q[j])), scale[j]));
        kacc[r] = kquant_acc(kacc[r], d, 0.f, x.scale(m, b), hsum_i32(s), 0, false);
      }
    } else if constexpr (Type == kQ4_K || Type == kQ5_K) {
      // scales in bytes 0..7, minimums in 8..15, built in registers: stored to memory as
      // bytes and loaded back as one word, they stall the load (no store forwarding)
      uint32_t sm_words[4];
      k_scale_words(w + 4, sm_words);
      const __m128i sm = _mm_setr_epi32(static_cast<int>(sm_words[0]),
                                        static_cast<int>(sm_words[1]),
                                        static_cast<int>(sm_words[2]),
                                        static_cast<int>(sm_words[3]));
      const uint8_t* qs = w + 16 + (Type == kQ5_K ? 32 : 0);
      __m256i q[8];  // sub-block j's 32 codes
      __m256i hb;
      if constexpr (Type == kQ5_K) hb = load32(w + 16);
      for (int c = 0; c < 4; ++c) {
        const __m256i p = load32(qs + 32 * c);
        q[2 * c] = _mm256_and_si256(p, low);
        q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
        if constexpr (Type == kQ5_K) {
          for (int h = 0; h < 2; ++h) {
            const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << (2 * c + h)));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit);
            q[2 * c + h] = _mm256_or_si256(q[2 * c + h],
                                           _mm256_and_si256(set, _mm256_set1_epi8(16)));
          }
        }
      }
      // int16 pairs of minimums (m_l for runs 2l and 2l + 1), against the runs' sums of x
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
          sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
      // each run's scale in every int16 lane: word j of the 8 scales, picked by a shuffle
      __m256i scale[8];
      broadcast_words(_mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm)), scale);
      const float d = f16(w), dmin = f16(w + 2);
      for (int r = 0; r < NR; ++r) {
        const int64_t m = m0 + r;
        const __m256i s = scaled_runs(q, scale, x.row(m) + b * 256);
        const __m256i t = _mm256_madd_epi16(load32(x.run_sums(m, b)), mins);
        kacc[r] = kquant_acc(kacc[r], d, dmin, x.scale(m, b), hsum_i32(s), hsum_i32(t), true);
      }
    } else {  // Q6_K
      // Run g (inputs 32 g ..) decoded and scaled when it is used, then against every row:
      // the 8 runs and their scales held at once need 16 registers, all AVX2 has.
      const auto* sc = reinterpret_cast<const int8_t*>(w + 192);
      // the 16 scales as int16: lanes 0..7 of run g's register take scale 2g, 8..15 2g + 1
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(sc)));
      // (shuffles of the scales' words, the 8 of the first half or of the second in both
      // lanes)
      const __m256i halves[2] = {
          _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sc16)),
          _mm256_broadcastsi128_si256(_mm256_extracti128_si256(sc16, 1))};
      const __m256i three = _mm256_set1_epi8(3);
      __m256i s[NR];
      for (int r = 0; r < NR; ++r) s[r] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const __m256i l[2] = {load32(w + h * 64), load32(w + h * 64 + 32)};
        const __m256i hi = load32(w + 128 + h * 32);
        for (int i = 0; i < 4; ++i) {  // run 4 h + i: low nibbles of l[0], l[1], then high
          const int g = 4 * h + i, lo = 2 * (g % 4);
          const __m256i nib = i < 2 ? l[i] : _mm256_srli_epi16(l[i - 2], 4);
          const __m256i q = _mm256_or_si256(
              _mm256_and_si256(nib, low),
              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 2 * i), three), 4));
          const __m256i scale = _mm256_shuffle_epi8(halves[g / 4], _mm256_setr_m128i(
              _mm_set1_epi16(static_cast<int16_t>((2 * lo) | ((2 * lo + 1) << 8))),
              _mm_set1_epi16(static_cast<int16_t>((2 * lo + 2) | ((2 * lo + 3) << 8)))));
          for (int r = 0; r < NR; ++r)
            s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(
                q, load32(x.row(m0 + r) + b * 256 + 32 * g)), scale));
          in_registers(s);
        }
      }
      const float d = f16(w + 208);
      for (int r = 0; r < NR; ++r) {
        const int64_t m = m0 + r;
        const __m256i c = _mm256_madd_epi16(load32(x.run_sums(m, b)), sc16);
        const __m256i t = _mm256_sub_epi32(s[r], _mm256_slli_epi32(c, 5));
        kacc[r] = kquant_acc(kacc[r], d, 0.f, x.scale(m, b), hsum_i32(t), 0, false);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    out[r] = one_acc(Type) ? kacc[r] : sum_lanes8(acc[r]);
}

template <int64_t Type>
void rows_avx2(const uint8_t* w, int64_t blocks, int64_t bytes, const QuantX& x, int64_t m0,
               int nr, float* out) {
  switch (nr) {
    case 1: row_dot_avx2<Type, 1>(w, blocks, bytes, x, m0, out); break;
    case 2: row_dot_avx2<Type, 2>(w, blocks, bytes, x, m0, out); break;
    case 3: row_dot_avx2<Type, 3>(w, blocks, bytes, x, m0, out); break;
    default: row_dot_avx2<Type, 4>(w, blocks, bytes, x, m0, out); break;
  }
}
// A Q4_Kx8 block's float steps for activation row m (kquant_acc in 8 lanes): s the rows'
// sums of codes times scales times x, mins[k] minimums 2k and 2k + 1 in a row's two int16
// lanes, d and dmin the rows' scales.
inline __m256 q4x8_acc(const __m256i* mins, __m256 d, __m256 dmin, const QuantX& x, int64_t m,
                       int64_t b, __m256i s, __m256 acc) {
  // sub-block sums of x: runs of 16 in pairs (vpmaddwd by ones), as int16 pairs 2k, 2k+1
  const __m256i bs = _mm256_madd_epi16(load32(x.run_sums(m, b)), _mm256_set1_epi16(1));
  const __m256i bs16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(bs, bs), 0xd8);
  __m256i t = _mm256_setzero_si256();
  for (int k = 0; k < 4; ++k)
    t = _mm256_add_epi32(t, _mm256_madd_epi16(
        mins[k], _mm256_permutevar8x32_epi32(bs16, _mm256_set1_epi32(k))));
  const __m256 dx = _mm256_set1_ps(x.scale(m, b));
  acc = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(s), acc);
  return _mm256_fmadd_ps(_mm256_xor_ps(_mm256_mul_ps(dmin, dx), _mm256_set1_ps(-0.f)),
                         _mm256_cvtepi32_ps(t), acc);
}

// A Q4_Kx8 block's minimums for q4x8_acc, from its words (k_scale_words for 8 rows at once).
inline void q4x8_mins(const uint8_t* g, __m256i* mins) {
  const __m256i u1 = load32(g + 64), u2 = load32(g + 96);
  const __m256i m6 = _mm256_set1_epi8(0x3f), m4 = _mm256_set1_epi8(0x0f),
                top = _mm256_set1_epi8(0x30);
  const __m256i mn_lo = _mm256_and_si256(u1, m6);
  const __m256i mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4),
                                        _mm256_and_si256(_mm256_srli_epi32(u1, 2), top));
  for (int k = 0; k < 4; ++k) {
    const char o = static_cast<char>(2 * (k % 2)), z = static_cast<char>(0x80);
    const __m256i pick = _mm256_setr_epi8(
        o, z, o + 1, z, o + 4, z, o + 5, z, o + 8, z, o + 9, z, o + 12, z, o + 13, z,
        o, z, o + 1, z, o + 4, z, o + 5, z, o + 8, z, o + 9, z, o + 12, z, o + 13, z);
    mins[k] = _mm256_shuffle_epi8(k < 2 ? mn_lo : mn_hi, pick);
  }
}

inline __m256 f16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 rows of Q4_Kx8 against NR activation rows, the rows in the lanes: per chunk, the 8 rows'
// 4 codes times 4 activations broadcast (vpmaddubsw; a sub-block's 8 chunks summed in int16,
// at most 8 * 2 * 15 * 127), then times the rows' scales (vpmaddwd) into int32 per row.
// Vnni: a sub-block's 8 chunks summed by vpdpbusd into one int32 per row (at most
// 32 * 15 * 127), then times the row's scale (vpmulld): the same integers.
template <int NR, bool Vnni>
void x8_dot_avx2(const uint8_t* g, int64_t blocks, const QuantX& x, int64_t m0, float* out) {
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i m6 = _mm256_set1_epi8(0x3f), m4 = _mm256_set1_epi8(0x0f),
                top = _mm256_set1_epi8(0x30);
  const uint8_t* ahead = g + kAhead;
  for (int64_t b = 0; b < blocks; ++b, g += kX8Bytes<kQ4_K>) {
    for (; ahead < g + kX8Bytes<kQ4_K> + kAhead; ahead += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    // k_scale_words for 8 rows at once: scale bytes 0-3 and 4-7
    const __m256i u0 = load32(g + 32), u2 = load32(g + 96);
    const __m256i sc_lo = _mm256_and_si256(u0, m6);
    const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(u2, m4),
                                          _mm256_and_si256(_mm256_srli_epi32(u0, 2), top));
    // sub-block j's scale in both int16 lanes of each row (Vnni: in its int32 lane): byte
    // j % 4 of the row's word
    __m256i scale[8];
    for (int j = 0; j < 8; ++j) {
      if constexpr (Vnni) {
        scale[j] = _mm256_and_si256(_mm256_srli_epi32(j < 4 ? sc_lo : sc_hi, 8 * (j % 4)),
                                    _mm256_set1_epi32(0xFF));
        continue;
      }
      const char o = static_cast<char>(j % 4), z = static_cast<char>(0x80);
      const __m256i pick = _mm256_setr_epi8(
          o, z, o, z, o + 4, z, o + 4, z, o + 8, z, o + 8, z, o + 12, z, o + 12, z,
          o, z, o, z, o + 4, z, o + 4, z, o + 8, z, o + 8, z, o + 12, z, o + 12, z);
      scale[j] = _mm256_shuffle_epi8(j < 4 ? sc_lo : sc_hi, pick);
    }
    __m256i mins[4];
    q4x8_mins(g, mins);
    const __m256 d = f16x8(g), dmin = f16x8(g + 16);
    __m256i s[NR];
    for (int r = 0; r < NR; ++r) s[r] = _mm256_setzero_si256();
    const uint8_t* qs = g + 128;
    for (int k = 0; k < 4; ++k) {
      __m256i lo[NR], hi[NR];  // int16 pairs (Vnni: int32) of sub-blocks 2k, 2k + 1
      for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i p = load32(qs + 32 * (8 * k + c));
        const __m256i qlo = _mm256_and_si256(p, low);
        const __m256i qhi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
        for (int r = 0; r < NR; ++r) {
          const int8_t* a = x.row(m0 + r) + b * 256 + 64 * k + 4 * c;
          int32_t alo, ahi;
          std::memcpy(&alo, a, 4);
          std::memcpy(&ahi, a + 32, 4);
          if constexpr (Vnni) {
            lo[r] = dpbusd(lo[r], qlo, _mm256_set1_epi32(alo));
            hi[r] = dpbusd(hi[r], qhi, _mm256_set1_epi32(ahi));
          } else {
            lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(qlo, _mm256_set1_epi32(alo)));
            hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(qhi, _mm256_set1_epi32(ahi)));
          }
        }
        in_registers(lo);
        in_registers(hi);
      }
      for (int r = 0; r < NR; ++r) {
        if constexpr (Vnni)
          s[r] = _mm256_add_epi32(s[r], _mm256_add_epi32(_mm256_mullo_epi32(lo[r], scale[2 * k]),
                                                         _mm256_mullo_epi32(hi[r],
                                                                            scale[2 * k + 1])));
        else
          s[r] = _mm256_add_epi32(s[r], _mm256_add_epi32(_mm256_madd_epi16(lo[r], scale[2 * k]),
                                                         _mm256_madd_epi16(hi[r],
                                                                           scale[2 * k + 1])));
      }
    }
    for (int r = 0; r < NR; ++r) acc[r] = q4x8_acc(mins, d, dmin, x, m0 + r, b, s[r], acc[r]);
  }
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// 8 rows' MXFP4 scales (e8m0_half in 8 lanes) from their exponent bytes at p.
inline __m256 e8m0x8(const uint8_t* p) {
  const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(
      normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

// A table type's levels made unsigned (kTableOffset added) in both 128-bit lanes: a vpshufb
// table.
template <int64_t Type>
inline __m256i table_unsigned() {
  return _mm256_add_epi8(iq4_levels<Type>(), _mm256_set1_epi8(kTableOffset<Type>));
}

// 8 rows' scales of a table type's x8 group (its first 8 kScaleBytes each), as floats.
template <int64_t Type>
inline __m256 table_scales8(const uint8_t* g) {
  if constexpr (Type == kMXFP4) return e8m0x8(g);
  return f16x8(g);
}

// 8 rows of MXFP4x8 or IQ4_NLx8 against NR activation rows, the rows in the lanes, each
// block's integer sum (table4_sum's) then kquant_acc's float steps in 8 lanes:
// - Vnni: per chunk, the 8 rows' 4 unsigned levels times 4 activations broadcast
//   (vpdpbusd), from a sum started at -kTableOffset times the block's sum of x.
// - MXFP4 without: vpmaddubsw of the unsigned levels (pairs at most 2 * 24 * 127; the 4 chunks
//   of the low nibbles summed in int16, at most 24384, and those of the high ones), pairs into
//   int32 by vpmaddwd, less 12 times the block's sum of x.
// - IQ4_NL without: its levels made unsigned reach 240, whose pairs would saturate int16, so
//   the signed levels' magnitudes against x taking their signs (pairs at most 2 * 127 * 127),
//   each chunk's pairs into int32 by vpmaddwd.
template <int64_t Type, int NR, bool Vnni>
void x8t_dot_avx2(const uint8_t* g, int64_t blocks, const QuantX& x, int64_t m0, float* out) {
  constexpr int64_t kBytes = kX8Bytes<Type>;
  constexpr bool kSigned = Type == kIQ4_NL && !Vnni;
  constexpr int kOff = kSigned ? 0 : kTableOffset<Type>;
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i table = kSigned ? iq4_levels<Type>() : table_unsigned<Type>();
  const uint8_t* ahead = g + kAhead;
  for (int64_t b = 0; b < blocks; ++b, g += kBytes) {
    for (; ahead < g + kBytes + kAhead; ahead += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    // MXFP4 without VNNI: int16 pairs; else lo alone, the int32 sums
    __m256i lo[NR], hi[NR];
    for (int r = 0; r < NR; ++r) {
      lo[r] = hi[r] = _mm256_setzero_si256();
      if constexpr (Vnni) lo[r] = _mm256_set1_epi32(-kOff * x.block_sum(m0 + r, b));
    }
    for (int c = 0; c < 4; ++c) {
      const __m256i p = load32(g + 8 * kScaleBytes<Type> + 32 * c);
      const __m256i ulo = _mm256_shuffle_epi8(table, _mm256_and_si256(p, low));
      const __m256i uhi = _mm256_shuffle_epi8(
          table, _mm256_and_si256(_mm256_srli_epi16(p, 4), low));
      for (int r = 0; r < NR; ++r) {
        const int8_t* a = x.row(m0 + r) + b * 32 + 4 * c;
        int32_t alo, ahi;
        std::memcpy(&alo, a, 4);
        std::memcpy(&ahi, a + 16, 4);
        const __m256i blo = _mm256_set1_epi32(alo), bhi = _mm256_set1_epi32(ahi);
        if constexpr (Vnni) {
          lo[r] = dpbusd(dpbusd(lo[r], ulo, blo), uhi, bhi);
        } else if constexpr (kSigned) {
          const __m256i plo = _mm256_maddubs_epi16(_mm256_abs_epi8(ulo),
                                                   _mm256_sign_epi8(blo, ulo));
          const __m256i phi = _mm256_maddubs_epi16(_mm256_abs_epi8(uhi),
                                                   _mm256_sign_epi8(bhi, uhi));
          lo[r] = _mm256_add_epi32(lo[r], _mm256_add_epi32(_mm256_madd_epi16(plo, ones),
                                                           _mm256_madd_epi16(phi, ones)));
        } else {
          lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(ulo, blo));
          hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(uhi, bhi));
        }
      }
      in_registers(lo);
      if constexpr (!Vnni && !kSigned) in_registers(hi);
    }
    const __m256 d = table_scales8<Type>(g);
    for (int r = 0; r < NR; ++r) {
      __m256i s = lo[r];
      if constexpr (!Vnni && !kSigned)
        s = _mm256_sub_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(lo[r], ones), _mm256_madd_epi16(hi[r], ones)),
            _mm256_set1_epi32(kOff * x.block_sum(m0 + r, b)));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.scale(m0 + r, b))),
                               _mm256_cvtepi32_ps(s), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// A Q6_Kx8 block's scales as int16 pairs for q6x8_acc: scales 2k, 2k + 1 of each row.
inline void q6x8_pairs(const uint8_t* g, __m256i* pairs) {
  for (int k = 0; k < 8; ++k) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 16 + 16 * k));
    pairs[k] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, _mm_srli_si128(v, 8)));
  }
}

// A Q6_Kx8 block's float steps for activation row m (kquant_acc in 8 lanes): s the rows' sums
// of codes times scales times x, less 32 times sum_j sc_j runs_j (the scales' pairs against
// the pair of x's sums of runs 2k, 2k + 1 broadcast).
inline __m256 q6x8_acc(const __m256i* pairs, __m256 d, const QuantX& x, int64_t m, int64_t b,
                       __m256i s, __m256 acc) {
  const int16_t* runs = x.run_sums(m, b);
  __m256i c = _mm256_setzero_si256();
  for (int k = 0; k < 8; ++k) {
    int32_t two;
    std::memcpy(&two, runs + 2 * k, 4);
    c = _mm256_add_epi32(c, _mm256_madd_epi16(pairs[k], _mm256_set1_epi32(two)));
  }
  const __m256i t = _mm256_sub_epi32(s, _mm256_slli_epi32(c, 5));
  return _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.scale(m, b))), _mm256_cvtepi32_ps(t),
                         acc);
}

// Q6_K codes of run `run` (0..3) of a chunk of 8 rows: the low nibbles in `nib` (already
// shifted down for runs 2, 3), bits 2 run, 2 run + 1 of qh (`hb`) moved to bits 4, 5.
inline __m256i q6_codes8(__m256i nib, __m256i hb, int run) {
  const __m256i hi = run == 2 ? hb : run < 2 ? _mm256_slli_epi16(hb, 4 - 2 * run)
                                             : _mm256_srli_epi16(hb, 2);
  const __m256i lo = _mm256_and_si256(nib, _mm256_set1_epi8(0x0F));
#if defined(__AVX512VL__)
  return _mm256_ternarylogic_epi32(lo, hi, _mm256_set1_epi8(0x30), 0xF8);  // a | (b & c)
#else
  return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
#endif
}

// 8 rows of Q6_Kx8 against NR activation rows, the rows in the lanes. Per run of 32 inputs
// and half of it (a sub-block of 16, one scale), its 4 chunks: the 8 rows' 4 codes (0..63)
// times 4 activations broadcast (vpmaddubsw), 2 chunks summed in int16 (at most
// 2 * 2 * 63 * 127 = 32004), then times the rows' scales (vpmaddwd) into int32 per row;
// less 32 times the scales times the sub-blocks' sums of x (Q6_K's codes are offset by 32).
// Vnni: a sub-block's 4 chunks summed by vpdpbusd into one int32 per row, then times the
// row's scale (vpmulld): the same integers.
template <int NR, bool Vnni>
void x8q6_dot_avx2(const uint8_t* g, int64_t blocks, const QuantX& x, int64_t m0,
                   float* out) {
  constexpr int64_t kBytes = kX8Bytes<kQ6_K>;
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* ahead = g + kAhead;
  for (int64_t b = 0; b < blocks; ++b, g += kBytes) {
    for (; ahead < g + kBytes + kAhead; ahead += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    __m256i s[NR];
    for (int r = 0; r < NR; ++r) s[r] = _mm256_setzero_si256();
    if constexpr (Vnni && NR == 1) {
      // One activation row (decode): each chunk's 3 loads (ql at + 0 and + 32, qh at + 64)
      // give the codes of all 4 runs of 32, decoded once, and each run's sums are a chain
      // of their own (4 independent chains of vpdpbusd).
      const int8_t* xa = x.row(m0) + b * 256;
      for (int h = 0; h < 2; ++h)
        for (int half = 0; half < 2; ++half) {
          __m256i p32[4];
          for (int run = 0; run < 4; ++run) p32[run] = _mm256_setzero_si256();
          for (int cc = 0; cc < 4; ++cc) {
            const int c = 4 * half + cc;
            const uint8_t* t = g + 144 + 96 * (8 * h + c);
            const __m256i l0 = load32(t), l1 = load32(t + 32), hb = load32(t + 64);
            for (int run = 0; run < 4; ++run) {
              const __m256i l = run % 2 ? l1 : l0;
              const __m256i q = q6_codes8(run < 2 ? l : _mm256_srli_epi16(l, 4), hb, run);
              int32_t a;
              std::memcpy(&a, xa + 128 * h + 32 * run + 4 * c, 4);
              p32[run] = dpbusd(p32[run], q, _mm256_set1_epi32(a));
            }
            in_registers(p32);
          }
          for (int run = 0; run < 4; ++run)  // times scale 8 h + 2 run + half of the 8 rows
            s[0] = _mm256_add_epi32(s[0], _mm256_mullo_epi32(p32[run], _mm256_cvtepi8_epi32(
                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                    g + 16 + 8 * (8 * h + 2 * run + half))))));
          in_registers(s);
        }
    } else {
      for (int h = 0; h < 2; ++h)
        for (int run = 0; run < 4; ++run)  // inputs 128 h + 32 run ..: ql's low nibbles first
          for (int half = 0; half < 2; ++half) {
            // scale j = 8 h + 2 run + half of the 8 rows, in both int16 lanes of each row
            const __m256i sc32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                reinterpret_cast<const __m128i*>(g + 16 + 8 * (8 * h + 2 * run + half))));
            const __m256i scale = Vnni ? sc32 : _mm256_or_si256(
                _mm256_and_si256(sc32, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sc32, 16));
            __m256i p32[NR];
            for (int r = 0; r < NR; ++r) p32[r] = _mm256_setzero_si256();
            for (int pair = 0; pair < 2; ++pair) {
              __m256i p16[NR];
              for (int r = 0; r < NR; ++r) p16[r] = _mm256_setzero_si256();
              for (int cc = 0; cc < 2; ++cc) {
                const int c = 4 * half + 2 * pair + cc;
                const uint8_t* t = g + 144 + 96 * (8 * h + c);
                const __m256i l = load32(t + 32 * (run % 2)), hb = load32(t + 64);
                const __m256i q = q6_codes8(run < 2 ? l : _mm256_srli_epi16(l, 4), hb, run);
                for (int r = 0; r < NR; ++r) {
                  int32_t a;
                  std::memcpy(&a, x.row(m0 + r) + b * 256 + 128 * h + 32 * run + 4 * c, 4);
                  if constexpr (Vnni)
                    p32[r] = dpbusd(p32[r], q, _mm256_set1_epi32(a));
                  else
                    p16[r] = _mm256_add_epi16(p16[r],
                                              _mm256_maddubs_epi16(q, _mm256_set1_epi32(a)));
                }
                if constexpr (Vnni)
                  in_registers(p32);
                else
                  in_registers(p16);
              }
              if constexpr (!Vnni) {
                for (int r = 0; r < NR; ++r)
                  s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p16[r], scale));
                in_registers(s);
              }
            }
            if constexpr (Vnni) {
              for (int r = 0; r < NR; ++r)
                s[r] = _mm256_add_epi32(s[r], _mm256_mullo_epi32(p32[r], scale));
              in_registers(s);
            }
          }
    }
    __m256i pairs[8];
    q6x8_pairs(g, pairs);
    const __m256 d = f16x8(g);
    for (int r = 0; r < NR; ++r) acc[r] = q6x8_acc(pairs, d, x, m0 + r, b, s[r], acc[r]);
  }
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 rows at once, two adjacent groups of an x8 part (g0's 8 rows, then g1's) in the 16 int32
// lanes of a 512-bit register: the x8 VNNI kernels' integer sums for both groups, one
// broadcast of the activations and one vpdpbusd per 64 products instead of two. The float
// steps are the 8-lane kernels' (q4x8_acc, q6x8_acc) in 16 lanes: the same operations lane
// by lane, so the same bits. out[16 r + i]: activation row m0 + r, row i of the 16.
//
// The chunk loops are unrolled (#pragma GCC unroll) and the accumulators left to the
// compiler: GCC 12 kept a rolled chunk loop's accumulators in a rotation of register copies
// and stack slots (~2 moves per vpdpbusd); unrolled, a chunk is its loads, 3 unpacking
// operations, and a broadcast and a vpdpbusd per activation row. On the Zen 5 of
// benchmarks/RESULTS.md that took Q4_Kx8 at 64-512 rows from ~36% of vpdpbusd's peak
// (2.3 T integer operations a second on 2 cores, measured) to ~55%, Q6_Kx8 by ~25%.
constexpr int64_t kPairRows = 8;  // activation rows per pass over 16 weight rows

inline __m512i load2x32(const uint8_t* a, const uint8_t* b) {  // a's 32 bytes low, b's high
  return _mm512_inserti64x4(_mm512_castsi256_si512(load32(a)), load32(b), 1);
}

// A Q4_K block's minimums for 16 rows (q4x8_mins for two groups at once): mins[k], int16
// lanes 2i, 2i + 1 minimums 2k and 2k + 1 of row i (g0's rows 0-7, then g1's).
inline void q4x16_mins(const uint8_t* g0, const uint8_t* g1, __m512i* mins) {
  const __m512i u1 = load2x32(g0 + 64, g1 + 64), u2 = load2x32(g0 + 96, g1 + 96);
  const __m512i m6 = _mm512_set1_epi8(0x3f), m4 = _mm512_set1_epi8(0x0f),
                top = _mm512_set1_epi8(0x30);
  const __m512i mn_lo = _mm512_and_si512(u1, m6);
  const __m512i mn_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), m4),
                                        _mm512_and_si512(_mm512_srli_epi32(u1, 2), top));
  for (int k = 0; k < 4; ++k) {
    const char o = static_cast<char>(2 * (k % 2)), z = static_cast<char>(0x80);
    const __m128i pick = _mm_setr_epi8(o, z, o + 1, z, o + 4, z, o + 5, z, o + 8, z, o + 9, z,
                                       o + 12, z, o + 13, z);
    mins[k] = _mm512_shuffle_epi8(k < 2 ? mn_lo : mn_hi, _mm512_broadcast_i32x4(pick));
  }
}

inline __m512 f16x16(const uint8_t* a, const uint8_t* b) {  // a's 8 halves, then b's
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

// Two streams read in step (the x16 kernels' two groups, rows2_vnni's two rows), prefetched
// line by line up to `end0` in the first and as far into the second, each line once: the
// pointers carry where they got to.
inline void prefetch_two(const uint8_t*& ahead0, const uint8_t*& ahead1, const uint8_t* end0) {
  for (; ahead0 < end0; ahead0 += 64, ahead1 += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead0), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead1), _MM_HINT_T0);
  }
}

// acc += vpdpbusd(u, the 4 signed bytes at p in every lane), the bytes broadcast from memory
// by the instruction itself ({1to16}): GCC 12 emits a vpbroadcastd and a vpdpbusd for the
// intrinsics, twice the instructions of the kernels' inner loops. On the Zen 5 of
// benchmarks/RESULTS.md, one thread, x16_q4k_vnni<8> alone ran ~9% faster for it (0.71
// against 0.65 T integer operations a second), and Q6_Kx8's kernel ~2%. What is left: a
// vpdpbusd with a broadcast from memory runs at ~78% of its rate with a register's (1.15 T
// a second a core), and the per-block float steps take ~12% of the kernel's time. A 32-row
// form reusing each broadcast in a register for two pairs reached 87% in its inner loop,
// but its sums no longer fit the 32 registers, and in all it ran no faster.
inline __m512i dpbusd_bcast(__m512i acc, __m512i u, const int8_t* p) {
  asm("vpdpbusd %[s]%{1to16%}, %[u], %[acc]"
      : [acc] "+v"(acc)
      : [u] "v"(u), [s] "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// Per block and sub-block pair k, the 16 rows' int32 sums of sub-blocks 2k and 2k + 1
// (lo, hi: 8 chunks each, one vpdpbusd per chunk and activation row), times their scales
// (vpmulld) into s; then q4x8_acc's float steps in 16 lanes (the same operations lane by
// lane, so the same bits), with t from the activations' sub-block sums as int16 pairs
// (QuantX::pairs, one broadcast per pair) against the rows' minimums.
template <int NR>
void x16_q4k_vnni(const uint8_t* g0, const uint8_t* g1, int64_t blocks, const QuantX& x,
                  int64_t m0, float* out) {
  constexpr int64_t kBytes = kX8Bytes<kQ4_K>;
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), byte = _mm512_set1_epi32(0xFF);
  const __m512 neg = _mm512_set1_ps(-0.f);
  const uint8_t *ahead0 = g0 + kAhead, *ahead1 = g1 + kAhead;
  const int8_t* xr[NR];
  for (int r = 0; r < NR; ++r) xr[r] = x.row(m0 + r);
  for (int64_t b = 0; b < blocks; ++b, g0 += kBytes, g1 += kBytes) {
    prefetch_two(ahead0, ahead1, g0 + kBytes + kAhead);
    __m512i s[NR];
    for (int r = 0; r < NR; ++r) s[r] = _mm512_setzero_si512();
    const uint8_t *qs0 = g0 + 128, *qs1 = g1 + 128;
    for (int k = 0; k < 4; ++k) {
      __m512i lo[NR], hi[NR];  // int32 sums of sub-blocks 2k, 2k + 1
      for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m512i p = load2x32(qs0 + 32 * (8 * k + c), qs1 + 32 * (8 * k + c));
        const __m512i qlo = _mm512_and_si512(p, low);
        const __m512i qhi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
        const int64_t at = b * 256 + 64 * k + 4 * c;
        for (int r = 0; r < NR; ++r) {
          lo[r] = dpbusd_bcast(lo[r], qlo, xr[r] + at);
          hi[r] = dpbusd_bcast(hi[r], qhi, xr[r] + at + 32);
        }
      }
      // k_scale_words for 16 rows: scale bytes 0-3 and 4-7 of each row's lane
      const __m512i words = k < 2 ? _mm512_and_si512(load2x32(g0 + 32, g1 + 32),
                                                     _mm512_set1_epi8(0x3f))
                                  : _mm512_or_si512(
                                        _mm512_and_si512(load2x32(g0 + 96, g1 + 96),
                                                         _mm512_set1_epi8(0x0f)),
                                        _mm512_and_si512(
                                            _mm512_srli_epi32(load2x32(g0 + 32, g1 + 32), 2),
                                            _mm512_set1_epi8(0x30)));
      const __m512i sl = _mm512_and_si512(_mm512_srli_epi32(words, 16 * (k % 2)), byte);
      const __m512i sh = _mm512_and_si512(_mm512_srli_epi32(words, 16 * (k % 2) + 8), byte);
      for (int r = 0; r < NR; ++r)
        s[r] = _mm512_add_epi32(s[r], _mm512_add_epi32(_mm512_mullo_epi32(lo[r], sl),
                                                       _mm512_mullo_epi32(hi[r], sh)));
    }
    __m512i mins[4];
    q4x16_mins(g0, g1, mins);
    const __m512 d = f16x16(g0, g1), dmin = f16x16(g0 + 16, g1 + 16);
    for (int r = 0; r < NR; ++r) {
      const int32_t* pr = x.pairs(m0 + r, b);
      __m512i t = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k)
        t = _mm512_add_epi32(t, _mm512_madd_epi16(mins[k], _mm512_set1_epi32(pr[k])));
      const __m512 dx = _mm512_set1_ps(x.scale(m0 + r, b));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(s[r]), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_xor_ps(_mm512_mul_ps(dmin, dx), neg),
                               _mm512_cvtepi32_ps(t), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

// Q6_K codes of run `run` (0..3) of a chunk: the low nibbles in `nib` (already shifted down
// for runs 2, 3) and bits 2 run, 2 run + 1 of qh (`hb`) moved to bits 4, 5: nib & 0x0F, then
// one vpternlogd for | (hi & 0x30).
inline __m512i q6_codes(__m512i nib, __m512i hb, int run) {
  const __m512i hi = run == 2 ? hb : run < 2 ? _mm512_slli_epi16(hb, 4 - 2 * run)
                                             : _mm512_srli_epi16(hb, 2);
  return _mm512_ternarylogic_epi32(_mm512_and_si512(nib, _mm512_set1_epi8(0x0F)), hi,
                                   _mm512_set1_epi8(0x30), 0xF8);  // a | (b & c)
}

// Scale j of 16 rows (8 of g0's group, 8 of g1's) as int32 lanes.
inline __m512i q6x16_scale(const uint8_t* g0, const uint8_t* g1, int j) {
  return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(g0 + 16 + 8 * j)),
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(g1 + 16 + 8 * j))));
}

template <int NR>
void x16_q6k_vnni(const uint8_t* g0, const uint8_t* g1, int64_t blocks, const QuantX& x,
                  int64_t m0, float* out) {
  constexpr int64_t kBytes = kX8Bytes<kQ6_K>;
  // The float accumulators live in `out`, leaving the registers to the 3 x NR integer sums.
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + 16 * r, _mm512_setzero_ps());
  const uint8_t *ahead0 = g0 + kAhead, *ahead1 = g1 + kAhead;
  const int8_t* xr[NR];
  for (int r = 0; r < NR; ++r) xr[r] = x.row(m0 + r);
  for (int64_t b = 0; b < blocks; ++b, g0 += kBytes, g1 += kBytes) {
    prefetch_two(ahead0, ahead1, g0 + kBytes + kAhead);
    __m512i s[NR];
    for (int r = 0; r < NR; ++r) s[r] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const uint8_t *t0 = g0 + 144 + 768 * h, *t1 = g1 + 144 + 768 * h;
      const int64_t at = b * 256 + 128 * h;
      // Runs rp and rp + 2 of each chunk share ql's bytes (low and high nibbles): one load
      // of them and of qh for both, and two sums per row (lo: run rp, hi: run rp + 2). On
      // the Zen 5 of benchmarks/RESULTS.md a run at a time (each chunk's bytes loaded for
      // every run) took 33.8 ms for the 1.5B's down projection at 496 rows, one thread,
      // against 28.5 (GCC kept the shared loads alive across runs and spilled the sums).
#pragma GCC unroll 2
      for (int rp = 0; rp < 2; ++rp)
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          __m512i lo[NR], hi[NR];
          for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
          for (int cc = 0; cc < 4; ++cc) {
            const int c = 4 * half + cc;
            const __m512i l = load2x32(t0 + 96 * c + 32 * rp, t1 + 96 * c + 32 * rp);
            const __m512i hb = load2x32(t0 + 96 * c + 64, t1 + 96 * c + 64);
            const __m512i qlo = q6_codes(l, hb, rp), qhi = q6_codes(_mm512_srli_epi16(l, 4), hb,
                                                                      rp + 2);
            for (int r = 0; r < NR; ++r) {
              lo[r] = dpbusd_bcast(lo[r], qlo, xr[r] + at + 32 * rp + 4 * c);
              hi[r] = dpbusd_bcast(hi[r], qhi, xr[r] + at + 32 * rp + 64 + 4 * c);
            }
          }
          const __m512i slo = q6x16_scale(g0, g1, 8 * h + 2 * rp + half);
          const __m512i shi = q6x16_scale(g0, g1, 8 * h + 2 * rp + 4 + half);
          for (int r = 0; r < NR; ++r)
            s[r] = _mm512_add_epi32(s[r], _mm512_add_epi32(_mm512_mullo_epi32(lo[r], slo),
                                                           _mm512_mullo_epi32(hi[r], shi)));
        }
    }
    // q6x8_acc in 16 lanes: the same operations lane by lane, so the same bits
    __m512i pairs[8];  // scales 2k, 2k + 1 of each row as int16 pairs
    for (int k = 0; k < 8; ++k) {
      const __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g0 + 16 + 16 * k));
      const __m128i v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g1 + 16 + 16 * k));
      pairs[k] = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_unpacklo_epi8(v0, _mm_srli_si128(v0, 8))),
          _mm_unpacklo_epi8(v1, _mm_srli_si128(v1, 8)), 1));
    }
    const __m512 d = f16x16(g0, g1);
    for (int r = 0; r < NR; ++r) {
      const int16_t* runs = x.run_sums(m0 + r, b);
      __m512i c = _mm512_setzero_si512();
      for (int k = 0; k < 8; ++k) {
        int32_t two;
        std::memcpy(&two, runs + 2 * k, 4);
        c = _mm512_add_epi32(c, _mm512_madd_epi16(pairs[k], _mm512_set1_epi32(two)));
      }
      const __m512i t = _mm512_sub_epi32(s[r], _mm512_slli_epi32(c, 5));
      _mm512_storeu_ps(out + 16 * r,
                       _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.scale(m0 + r, b))),
                                       _mm512_cvtepi32_ps(t), _mm512_loadu_ps(out + 16 * r)));
    }
  }
}

// 16 rows' scales of two table-type x8 groups: table_scales8 of g0's, then of g1's.
template <int64_t Type>
inline __m512 table_scales16(const uint8_t* g0, const uint8_t* g1) {
  return _mm512_castpd_ps(_mm512_insertf64x4(
      _mm512_castps_pd(_mm512_castps256_ps512(table_scales8<Type>(g0))),
      _mm256_castps_pd(table_scales8<Type>(g1)), 1));
}

// MXFP4x8's or IQ4_NLx8's 16 rows (two adjacent groups) on vpdpbusd: per block, the 8 chunk
// halves' levels made unsigned once (vpshufb), then for each activation row 8 vpdpbusd from
// a sum started at -kTableOffset times the block's sum of x (table4_sum's integer), and one
// float step (kquant_acc's, in 16 lanes).
template <int64_t Type, int NR>
void x16_table_vnni(const uint8_t* g0, const uint8_t* g1, int64_t blocks, const QuantX& x,
                    int64_t m0, float* out) {
  constexpr int64_t kBytes = kX8Bytes<Type>;
  constexpr int h = kScaleBytes<Type>;
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i table = _mm512_broadcast_i64x4(table_unsigned<Type>());
  const uint8_t *ahead0 = g0 + kAhead, *ahead1 = g1 + kAhead;
  const int8_t* xr[NR];
  for (int r = 0; r < NR; ++r) xr[r] = x.row(m0 + r);
  for (int64_t b = 0; b < blocks; ++b, g0 += kBytes, g1 += kBytes) {
    prefetch_two(ahead0, ahead1, g0 + kBytes + kAhead);
    __m512i u[8];  // chunk c's low nibbles' levels (inputs 4c ..), then its high ones' (16 + 4c ..)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i p = load2x32(g0 + 8 * h + 32 * c, g1 + 8 * h + 32 * c);
      u[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(p, low));
      u[4 + c] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(p, 4), low));
    }
    const __m512 d = table_scales16<Type>(g0, g1);
    for (int r = 0; r < NR; ++r) {
      const int8_t* a = xr[r] + b * 32;
      __m512i s = _mm512_set1_epi32(-kTableOffset<Type> * x.block_sum(m0 + r, b));
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) s = dpbusd_bcast(s, u[i], a + 4 * (i % 4) + 16 * (i / 4));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.scale(m0 + r, b))),
                               _mm512_cvtepi32_ps(s), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

template <int64_t Type, int NR>
void x16_dot(const uint8_t* g0, const uint8_t* g1, int64_t blocks, const QuantX& x, int64_t m0,
             float* out) {
  if constexpr (Type == kQ4_K)
    x16_q4k_vnni<NR>(g0, g1, blocks, x, m0, out);
  else if constexpr (is_table4(Type))
    x16_table_vnni<Type, NR>(g0, g1, blocks, x, m0, out);
  else
    x16_q6k_vnni<NR>(g0, g1, blocks, x, m0, out);
}

// Two adjacent groups (g, g + stride) against activation rows m0 .. m0 + nr - 1.
template <int64_t Type>
void x16_vnni(const uint8_t* g, int64_t stride, int64_t blocks, const QuantX& x, int64_t m0,
              int nr, float* out) {
  switch (nr) {
    case 1: x16_dot<Type, 1>(g, g + stride, blocks, x, m0, out); break;
    case 2: x16_dot<Type, 2>(g, g + stride, blocks, x, m0, out); break;
    case 3: x16_dot<Type, 3>(g, g + stride, blocks, x, m0, out); break;
    case 4: x16_dot<Type, 4>(g, g + stride, blocks, x, m0, out); break;
    case 5: x16_dot<Type, 5>(g, g + stride, blocks, x, m0, out); break;
    case 6: x16_dot<Type, 6>(g, g + stride, blocks, x, m0, out); break;
    case 7: x16_dot<Type, 7>(g, g + stride, blocks, x, m0, out); break;
    default: x16_dot<Type, 8>(g, g + stride, blocks, x, m0, out); break;
  }
}

// Two weight rows of a table type (IQ4_NL, MXFP4: the file's layout) against one activation
// row m, in 512-bit registers: row 0's block in the low 256 bits, row 1's in the high, so
// that one instruction does what row_dot_avx2 does for one row. Each half keeps its row's
// lanes and float steps (the same int32 sums, the same fused multiply-adds in block order):
// vpdpbusd of the levels made unsigned (level + off) against x, less off times x's lane
// sums, is the sum row_dot_avx2 makes of the signed levels; MXFP4's one accumulator
// (one_acc) takes each half's 8 lanes summed into its first (exact), whose float steps are
// then kquant_acc's. Row by row, the block-of-32 pipeline held an MXFP4 GEMV to 8-10 GB/s at
// one row on a Zen 4, far from the memory's.
template <int64_t Type>
void rows2_vnni(const uint8_t* w0, const uint8_t* w1, int64_t blocks, int64_t bytes,
                const QuantX& x, int64_t m, float* out) {
  static_assert(is_table4(Type), "a table of 16 signed levels");
  constexpr int off = kTableOffset<Type>;
  const __m512i table = _mm512_broadcast_i64x4(table_unsigned<Type>());
  const __m512i low = _mm512_set1_epi8(0x0F), offs = _mm512_set1_epi32(off);
  const __m512i zero = _mm512_setzero_si512();
  constexpr int at = codes32_at<Type>();
  __m512 acc = _mm512_setzero_ps();
  const int8_t* xr = x.row(m);
  const uint8_t* ahead0 = w0 + kAhead;
  const uint8_t* ahead1 = w1 + kAhead;
  for (int64_t b = 0; b < blocks; ++b, w0 += bytes, w1 += bytes) {
    prefetch_two(ahead0, ahead1, w0 + bytes + kAhead);
    const __m128i c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w0 + at));
    const __m128i c1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w1 + at));
    // [c0 | c0 | c1 | c1], the second copy of each shifted down a nibble: each row's 32
    // codes in order, as _mm256_set_m128i(srli(qs, 4), qs) lays them out
    const __m512i both = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_set_m128i(c0, c0)), _mm256_set_m128i(c1, c1), 1);
    const __m512i codes = _mm512_and_si512(
        _mm512_mask_srli_epi16(both, 0xFF00FF00u, both, 4), low);
    const __m512i a = _mm512_broadcast_i64x4(load32(xr + b * 32));
    const __m512i xs = _mm512_broadcast_i64x4(load32(x.lane_sums(m, b)));
    __m512i s = _mm512_sub_epi32(
        _mm512_dpbusd_epi32(zero, _mm512_shuffle_epi8(table, codes), a),
        _mm512_mullo_epi32(xs, offs));
    if constexpr (one_acc(Type)) {  // lanes 0 and 8: each row's whole sum
      s = _mm512_add_epi32(s, _mm512_bsrli_epi128(s, 8));
      s = _mm512_add_epi32(s, _mm512_bsrli_epi128(s, 4));
      s = _mm512_add_epi32(s, _mm512_shuffle_i32x4(s, s, 0xB1));  // 128-bit lanes swapped
    }
    const float dx = x.scale(m, b);
    const __m512 dd = _mm512_insertf32x8(_mm512_set1_ps(scale32<Type>(w0) * dx),
                                         _mm256_set1_ps(scale32<Type>(w1) * dx), 1);
    acc = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(s), acc);
  }
  if constexpr (one_acc(Type)) {
    out[0] = _mm512_cvtss_f32(acc);
    out[1] = _mm_cvtss_f32(_mm512_extractf32x4_ps(acc, 2));
  } else {
    out[0] = sum_lanes8(_mm512_castps512_ps256(acc));
    out[1] = sum_lanes8(_mm512_extractf32x8_ps(acc, 1));
  }
}
#else
constexpr int64_t kPairRows = kRows;
#endif

template <int64_t Type, int NR, bool Vnni>
void x8_dot(const uint8_t* g, int64_t blocks, const QuantX& x, int64_t m0, float* out) {
  if constexpr (Type == kQ4_K)
    x8_dot_avx2<NR, Vnni>(g, blocks, x, m0, out);
  else if constexpr (is_table4(Type))
    x8t_dot_avx2<Type, NR, Vnni>(g, blocks, x, m0, out);
  else
    x8q6_dot_avx2<NR, Vnni>(g, blocks, x, m0, out);
}

template <int64_t Type, bool Vnni>
void x8_avx2(const uint8_t* g, int64_t blocks, const QuantX& x, int64_t m0, int nr,
             float* out) {
  switch (nr) {
    case 1: x8_dot<Type, 1, Vnni>(g, blocks, x, m0, out); break;
    case 2: x8_dot<Type, 2, Vnni>(g, blocks, x, m0, out); break;
    case 3: x8_dot<Type, 3, Vnni>(g, blocks, x, m0, out); break;
    case 4: x8_dot<Type, 4, Vnni>(g, blocks, x, m0, out); break;
    case 5: x8_dot<Type, 5, Vnni>(g, blocks, x, m0, out); break;
    case 6: x8_dot<Type, 6, Vnni>(g, blocks, x, m0, out); break;
    case 7: x8_dot<Type, 7, Vnni>(g, blocks, x, m0, out); break;
    default: x8_dot<Type, 8, Vnni>(g, blocks, x, m0, out); break;
  }
}
#else
constexpr bool kHasAvx2Path = false;
constexpr bool kHasVnniPath = false;
constexpr int kRows = 4;
constexpr int64_t kPairRows = kRows;
#endif

// The paths gguf_linear can take, best first where built: VNNI (the x8 layouts on vpdpbusd;
// the file's layouts on AVX2's kernels), AVX2, portable. All give the same bits.
enum class Path { kPortable, kAvx2, kVnni };

Path best_path() {
  return kHasVnniPath ? Path::kVnni : kHasAvx2Path ? Path::kAvx2 : Path::kPortable;
}

const char* path_name(Path path) {
  return path == Path::kVnni ? "VNNI" : path == Path::kAvx2 ? "AVX2" : "portable";
}

// The activations quantized for `path`: its own form of the one arithmetic (the same bits).
template <typename T>
void quantize_x(const T* x, int64_t M, int64_t K, int64_t block, QuantX& out, Path path) {
  (void)path;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (path != Path::kPortable)
    quantize_x_avx2(x, M, K, block, out);
  else
#endif
    quantize_x_portable(x, M, K, block, out);
  if (block == 32)  // integers: the same on every path
    for (size_t i = 0; i < out.sums.size(); ++i) {
      const int32_t* l = out.lanes.data() + 8 * i;
      out.sums[i] = l[0] + l[1] + l[2] + l[3] + l[4] + l[5] + l[6] + l[7];
    }
}

// n results of one activation row as T (bf16: c10::BFloat16's rounding, kvs::narrow_row's
// vectors off the portable path): with 16 weight rows a pass, the scalar conversion was ~4%
// of a prefill.
template <typename T>
inline void store_out(T* dst, const float* src, int n, Path path) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (path != Path::kPortable) {
    kvs::narrow_row(src, dst, n);
  } else {
    for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

// "" for the best path built here, else one of path_name's names that is built here.
Path parse_path(const std::string& name) {
  if (name.empty()) return best_path();
  for (Path p : {Path::kPortable, Path::kAvx2, Path::kVnni})
    if (name == path_name(p)) {
      TORCH_CHECK(p <= best_path(), "gguf_linear: path ", name, " is not built for this CPU",
                  " (best here: ", path_name(best_path()), ")");
      return p;
    }
  TORCH_CHECK(false, "gguf_linear: unknown path '", name, "' (VNNI, AVX2 or portable)");
}

// One weight row (`w`, `blocks` blocks) against activation rows m0 .. m0 + nr - 1.
using RowsFn = void (*)(const uint8_t*, int64_t, int64_t, const QuantX&, int64_t, int, float*);

template <int64_t Type>
RowsFn rows_fn(Path path) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (path != Path::kPortable) return rows_avx2<Type>;
#endif
  (void)path;
  return rows_portable<Type>;
}

// Two weight rows against one activation row (rows2_vnni), for the types that have it on
// the VNNI path; else null. At one row it read an MXFP4 matrix (in the lanes' form MXFP4
// had before MXFP4x8) 1.6-1.7x as fast as row_dot_avx2 (8192 x 2880: 9.2 -> 16.0 GB/s,
// Zen 4); at four it made no difference (45-49 against 40-57 GMAC/s at 512 rows).
using Rows2Fn = void (*)(const uint8_t*, const uint8_t*, int64_t, int64_t, const QuantX&,
                         int64_t, float*);

Rows2Fn pick2(int64_t type, Path path) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
  if (path == Path::kVnni) {
    if (type == kMXFP4) return rows2_vnni<kMXFP4>;
    if (type == kIQ4_NL) return rows2_vnni<kIQ4_NL>;
  }
#endif
  (void)type;
  (void)path;
  return nullptr;
}

RowsFn pick(int64_t type, Path path) {
  switch (type) {
    case kQ4_0: return rows_fn<kQ4_0>(path);
    case kQ4_1: return rows_fn<kQ4_1>(path);
    case kQ5_0: return rows_fn<kQ5_0>(path);
    case kQ5_1: return rows_fn<kQ5_1>(path);
    case kQ8_0: return rows_fn<kQ8_0>(path);
    case kQ4_K: return rows_fn<kQ4_K>(path);
    case kQ5_K: return rows_fn<kQ5_K>(path);
    case kIQ4_NL: return rows_fn<kIQ4_NL>(path);
    case kIQ4_XS: return rows_fn<kIQ4_XS>(path);
    case kMXFP4: return rows_fn<kMXFP4>(path);
    default: return rows_fn<kQ6_K>(path);
  }
}

// 8 interleaved rows (a part row of an x8 layout) against activation rows m0 .. m0 + nr - 1.
using GroupFn = void (*)(const uint8_t*, int64_t, const QuantX&, int64_t, int, float*);

template <int64_t Type>
GroupFn group_fn(Path path) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (kHasVnniPath)
    if (path == Path::kVnni) return x8_avx2<Type, true>;
  if (path != Path::kPortable) return x8_avx2<Type, false>;
#endif
  (void)path;
  return x8_portable<Type>;
}

// For a call of M activation rows. At decode sizes (M <= kRows) the VNNI path takes the AVX2
// form, except for Q6_Kx8 at one row: with few rows the VNNI form's sums are short chains of
// dependent vpdpbusd where vpmaddubsw's products are independent, and on a Zen 4 one row
// against weights streamed from memory ran 1.2-2.5x faster on it. Q6_Kx8's one-row VNNI
// kernel keeps 4 chains and decodes each chunk once for 4 runs: 1.25-1.35x the AVX2 form's
// speed there (Q4_Kx8's, with its chains split the same way, ran even with it). The same
// bits on every form.
GroupFn pick_group(int64_t x8, Path path, int64_t M) {
  if (x8 == kMXFP4x8) return group_fn<kMXFP4>(path);
  if (x8 == kIQ4_NLx8) return group_fn<kIQ4_NL>(path);
  if (path == Path::kVnni && M <= kRows && !(x8 == kQ6_Kx8 && M == 1)) path = Path::kAvx2;
  return x8 == kQ4_Kx8 ? group_fn<kQ4_K>(path) : group_fn<kQ6_K>(path);
}

// Two adjacent groups of an x8 part (16 rows, the second `stride` bytes after the first)
// against activation rows m0 .. m0 + nr - 1: out[16 r + i].
using PairFn = void (*)(const uint8_t*, int64_t, int64_t, const QuantX&, int64_t, int, float*);

// Where built, for a call of M rows above decode sizes (see pick_group).
PairFn pick_pair(int64_t x8, Path path, int64_t M) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (path == Path::kVnni && x8 == kMXFP4x8) return x16_vnni<kMXFP4>;
  if (path == Path::kVnni && x8 == kIQ4_NLx8) return x16_vnni<kIQ4_NL>;
  if (path == Path::kVnni && M > kRows) return x8 == kQ4_Kx8 ? x16_vnni<kQ4_K> : x16_vnni<kQ6_K>;
#endif
  (void)x8;
  (void)path;
  (void)M;
  return nullptr;
}

// Output rows per unit of work: a unit's weights stay in L1/L2 while every activation row
// passes over them (64 rows: 55-320 KB of Q4_K at 1536-8960 inputs). A unit lies in one part
// (and so holds whole groups of an x8 part). On the Zen 5 of benchmarks/RESULTS.md, 64 rows
// against 16 took a 500-token prefill of the 1.5B from 1219 to 1192 ms (medians of 15, builds
// alternated) and its matrices alone 2-7% faster; decode steps, which stream each weight
// once, kept 16 (within noise of 64: 22.9 against 23.2 ms, 10 runs each).
int64_t unit_rows(int64_t M) { return M > kRows ? 64 : 16; }

// The largest next unit fetched into L2 ahead of its turn: beside the unit being read (as
// large), it must leave room in L2 (512 KiB on a Zen 3, 1 MiB on a Zen 4). A 1.5B's down
// projection (64 rows of 8960 Q6_K inputs, 470 KB) gained nothing from it at 512 rows
// (1.04x the time, within noise). Experts' units (40-100 KB) gain most: see run().
constexpr int64_t kPrefetchUnit = 128 << 10;

// One matrix against activation rows [m_begin, m_end): gguf_linear's whole call, or one
// expert's rows of gguf_grouped.
struct Job {
  const GGUFMatrix* w;
  int64_t m_begin, m_end;
};

// The jobs' rows, each job's matrix giving the N columns of its rows of y [M, N]. Units of
// work are a job's part's runs of output rows, so a row's results come from its own
// activations and its matrix alone, whichever jobs share the call.
template <typename T>
at::Tensor run(const at::Tensor& x, const std::vector<Job>& jobs, Path path) {
  const int64_t M = x.size(0), K = x.size(1);
  // Everything a row needs, read off the tensors once: their accessors cost tens of
  // nanoseconds a call, and a call has up to 150k rows (an LM head) times M / kRows passes.
  struct Part {
    const uint8_t* base;
    int64_t stride, blocks, bytes, begin, n;  // begin: its first output column; n: its rows
    int64_t m_begin, m_end;                    // the activation rows it is applied to
    const int64_t* order;
    RowsFn fn;      // a row at a time (the file's layouts)
    Rows2Fn fn2;    // two rows against one activation row (some types), else null
    GroupFn group;  // 8 rows at a time (the x8 layouts), else null
    PairFn pair;    // 16 rows at a time (the x8 layouts, where built), else null
    const QuantX* x;
  };
  QuantX x32, x256;
  std::vector<Part> part;
  std::vector<std::pair<size_t, int64_t>> units;  // (part, first row)
  bool need32 = false, need256 = false;
  int64_t N = -1;
  for (const Job& job : jobs) {
    const GGUFMatrix& w = *job.w;
    const int64_t rows_here = job.m_end - job.m_begin, unit = unit_rows(rows_here);
    int64_t n_job = 0;
    for (size_t p = 0; p < w.parts.size(); ++p) {
      TypeInfo info;
      type_info(w.types[p], &info);
      (info.block == 32 ? need32 : need256) = true;
      const bool x8 = info.group > 1;
      const at::Tensor& order = w.rows[p];
      const int64_t n = x8 ? w.parts[p].size(0) * info.group
                           : order.numel() ? order.numel() : w.parts[p].size(0);
      for (int64_t r = 0; r < n; r += unit) units.emplace_back(part.size(), r);
      part.push_back({static_cast<const uint8_t*>(w.parts[p].data_ptr()), w.parts[p].stride(0),
                      K / info.block, info.bytes, n_job, n, job.m_begin, job.m_end,
                      order.numel() ? order.data_ptr<int64_t>() : nullptr,
                      x8 ? nullptr : pick(w.types[p], path),
                      x8 ? nullptr : pick2(w.types[p], path),
                      x8 ? pick_group(w.types[p], path, rows_here) : nullptr,
                      x8 ? pick_pair(w.types[p], path, rows_here) : nullptr,
                      info.block == 32 ? &x32 : &x256});
      n_job += n;
    }
    TORCH_CHECK(N < 0 || n_job == N, "gguf_grouped: every matrix must have the same outputs");
    N = n_job;
  }
  const T* xp = x.data_ptr<T>();
  if (need32) quantize_x(xp, M, K, 32, x32, path);
  if (need256) quantize_x(xp, M, K, 256, x256, path);
  auto y = at::empty({M, std::max<int64_t>(N, 0)}, x.options());
  T* yp = y.data_ptr<T>();
  // A unit's part and its output rows [r0, r1).
  struct Span {
    const Part* q;
    int64_t r0, r1;
  };
  const auto span = [&](size_t u) {
    const Part& q = part[units[u].first];
    const int64_t r0 = units[u].second;
    return Span{&q, r0, std::min(q.n, r0 + unit_rows(q.m_end - q.m_begin))};
  };
  // One unit: its weight rows against every activation row of its part's job. `next`: the
  // unit this thread runs after it (or units.size()), whose weights are fetched into L2 a
  // slice before each of this unit's kernel calls. A unit's first pass over its weights
  // reads them from L3 or memory, its later passes from L2: an expert's unit, with ~31 rows
  // in a 500-token prefill of Qwen3-30B-A3B's shape, makes 4 passes where a dense matrix at
  // 512 rows makes 64. Interleaved with the build before it on the Zen 4 of
  // benchmarks/RESULTS.md (gguf_grouped, 128 experts x 32 rows, medians of 11-15): gate/up
  // (1536 x 2048 Q4_K) 0.90-0.97x the time, down (2048 x 768 Q6_K) 0.88-0.94x; one matrix at
  // 512 rows 0.99-1.00x.
  const auto unit_work = [&](size_t u, size_t next, float* out) {
    const auto [qp, r0, r1] = span(u);
    const Part& q = *qp;
    if (q.group != nullptr) {
      const int64_t pass = q.pair != nullptr ? kPairRows : kRows;
      const uint8_t *ahead = nullptr, *ahead_end = nullptr;
      int64_t step_lines = 0;
      const Span after = next < units.size() ? span(next) : Span{nullptr, 0, 0};
      if (after.q != nullptr && after.q->group != nullptr && q.m_end - q.m_begin > kRows) {
        const Part& a = *after.q;  // an x8 part: 8 rows a part row
        ahead = a.base + (after.r0 / 8) * a.stride;
        ahead_end = a.base + ((after.r1 + 7) / 8) * a.stride;
        if (ahead_end - ahead > kPrefetchUnit) ahead_end = ahead;
        const int64_t calls = ((q.m_end - q.m_begin + pass - 1) / pass) * ((r1 - r0 + 15) / 16);
        step_lines = ((ahead_end - ahead) / 64 + calls - 1) / std::max<int64_t>(calls, 1);
      }
      for (int64_t m0 = q.m_begin; m0 < q.m_end; m0 += pass) {  // 2 and 3 rows: no faster
        const int nr = static_cast<int>(std::min<int64_t>(pass, q.m_end - m0));
        for (int64_t r = r0; r < r1;) {
          for (int64_t l = 0; l < step_lines && ahead < ahead_end; ++l, ahead += 64)
            __builtin_prefetch(ahead, 0, 2);
          const uint8_t* g = q.base + (r / 8) * q.stride;
          const int n = q.pair != nullptr && r + 16 <= r1 ? 16 : 8;
          if (n == 16)
            q.pair(g, q.stride, q.blocks, *q.x, m0, nr, out);
          else
            q.group(g, q.blocks, *q.x, m0, nr, out);
          for (int a = 0; a < nr; ++a)
            store_out(yp + (m0 + a) * N + q.begin + r, out + n * a, n, path);
          r += n;
        }
      }
      return;
    }
    for (int64_t m0 = q.m_begin; m0 < q.m_end; m0 += kRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kRows, q.m_end - m0));
      int64_t r = r0;
      if (nr == 1 && q.fn2 != nullptr) {
        for (; r + 2 <= r1; r += 2) {
          q.fn2(q.base + (q.order ? q.order[r] : r) * q.stride,
                q.base + (q.order ? q.order[r + 1] : r + 1) * q.stride, q.blocks, q.bytes,
                *q.x, m0, out);
          yp[m0 * N + q.begin + r] = static_cast<T>(out[0]);
          yp[m0 * N + q.begin + r + 1] = static_cast<T>(out[1]);
        }
      }
      for (; r < r1; ++r) {
        const uint8_t* w = q.base + (q.order ? q.order[r] : r) * q.stride;
        q.fn(w, q.blocks, q.bytes, *q.x, m0, nr, out);
        for (int a = 0; a < nr; ++a) yp[(m0 + a) * N + q.begin + r] = static_cast<T>(out[a]);
      }
    }
  };
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    float out[kPairRows * 16];
    for (int64_t u = begin; u < end; ++u)
      unit_work(static_cast<size_t>(u), u + 1 < end ? static_cast<size_t>(u + 1) : units.size(),
                out);
  });
  return y;
}

// ---------------------------------------------------------------------- dequantization

// Block `b` of a row as gguf's numpy code computes it (same operations, no fusing).
void dequant_block(int64_t type, const uint8_t* w, float* out) {
  switch (type) {
    case kQ8_0: {
      const float d = f16(w);
      for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(static_cast<int8_t>(w[2 + i])) * d;
      return;
    }
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: {
      const bool hasmin = type == kQ4_1 || type == kQ5_1, five = type == kQ5_0 || type == kQ5_1;
      const float d = f16(w), mn = hasmin ? f16(w + 2) : 0.f;
      const uint32_t qh = five ? u32(w + (hasmin ? 4 : 2)) : 0;
      const uint8_t* qs = w + (hasmin ? 4 : 2) + (five ? 4 : 0);
      for (int i = 0; i < 32; ++i) {
        int32_t q = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
        if (five) q |= ((qh >> i) & 1) << 4;
        if (hasmin)
          out[i] = d * static_cast<float>(q) + mn;
        else
          out[i] = d * static_cast<float>(q - (five ? 16 : 8));
      }
      return;
    }
    case kIQ4_NL: {
      const float d = f16(w);
      for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(code32<kIQ4_NL>(w, i));
      return;
    }
    case kMXFP4: {  // as gguf: the exponent's float times each level
      const float d = e8m0_half(w[0]);
      for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(code32<kMXFP4>(w, i));
      return;
    }
    case kIQ4_XS: {  // as gguf: each sub-block's d * scale, then times its levels
      const float d = f16(w);
      for (int j = 0; j < 8; ++j) {
        const float dl = d * static_cast<float>(iq4xs_scale(w, j));
        for (int i = 0; i < 16; ++i) {
          const uint8_t c = w[8 + 16 * j + i];
          out[32 * j + i] = dl * static_cast<float>(kIQ4Levels[c & 15]);
          out[32 * j + 16 + i] = dl * static_cast<float>(kIQ4Levels[c >> 4]);
        }
      }
      return;
    }
    case kQ4_K: case kQ5_K: {
      uint8_t sc[8], mn[8];
      k_scales(w + 4, sc, mn);
      const float d = f16(w), dmin = f16(w + 2);
      const uint8_t *qh = w + 16, *qs = w + 16 + (type == kQ5_K ? 32 : 0);
      for (int j = 0; j < 8; ++j) {
        const float dl = d * static_cast<float>(sc[j]), ml = dmin * static_cast<float>(mn[j]);
        for (int i = 0; i < 32; ++i) {
          int32_t q = (qs[(j / 2) * 32 + i] >> (4 * (j % 2))) & 15;
          if (type == kQ5_K) q |= ((qh[i] >> j) & 1) << 4;
          out[j * 32 + i] = dl * static_cast<float>(q) - ml;
        }
      }
      return;
    }
    default: {  // Q6_K
      const uint8_t *ql = w, *qh = w + 128;
      const auto* sc = reinterpret_cast<const int8_t*>(w + 192);
      const float d = f16(w + 208);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, g = (e % 128) / 32, l = e % 32;
        const int32_t q = ((ql[h * 64 + (g % 2) * 32 + l] >> (4 * (g / 2))) & 15) |
                          (((qh[h * 32 + l] >> (2 * g)) & 3) << 4);
        out[e] = d * static_cast<float>(sc[e / 16]) * static_cast<float>(q - 32);
      }
      return;
    }
  }
}

void check_part(const char* fn, const at::Tensor& part, int64_t type, int64_t K) {
  TypeInfo info;
  TORCH_CHECK(type_info(type, &info), fn, ": GGML type ", type, " has no kernel");
  TORCH_CHECK(part.dim() == 2 && part.scalar_type() == at::kByte && part.stride(1) == 1,
              fn, ": a part must be [rows, row bytes] uint8 with contiguous rows");
  TORCH_CHECK(K % info.block == 0 && part.size(1) == K / info.block * info.bytes, fn,
              ": a row of ", part.size(1), " bytes is not ", K, " inputs of GGML type ", type);
}

// A row order (int64 [n], each < rows), or none (empty); its rows, or null.
const int64_t* check_order(const char* fn, const at::Tensor& order, int64_t rows) {
  if (!order.numel()) return nullptr;
  TORCH_CHECK(order.scalar_type() == at::kLong && order.dim() == 1 && order.is_contiguous(),
              fn, ": a row order must be int64 [N]");
  const int64_t* r = order.data_ptr<int64_t>();
  for (int64_t i = 0; i < order.numel(); ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < rows, fn, ": row out of range");
  return r;
}

// A matrix's parts checked against K inputs (`fn` names the caller in errors).
void check_matrix(const char* fn, const GGUFMatrix& w, int64_t K) {
  kvs::check_cpu(fn, w.parts);
  kvs::check_cpu(fn, w.rows);
  TORCH_CHECK(!w.parts.empty() && w.parts.size() == w.types.size() &&
                  w.rows.size() == w.parts.size(),
              fn, ": one type and one row list per part");
  for (size_t p = 0; p < w.parts.size(); ++p) {
    check_part(fn, w.parts[p], w.types[p], K);
    TORCH_CHECK(w.types[p] < kX8 || w.rows[p].numel() == 0,
                fn, ": an interleaved part takes no row order (gguf_repack applies it)");
    check_order(fn, w.rows[p], w.parts[p].size(0));
  }
}

void check_x(const char* fn, const at::Tensor& x) {
  kvs::check_cpu(fn, x);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat ||
                               x.scalar_type() == at::kBFloat16),
              fn, ": x must be [M, K] float32 or bf16");
}

at::Tensor run_jobs(const at::Tensor& x, const std::vector<Job>& jobs, Path path) {
  auto xc = x.contiguous();
  return x.scalar_type() == at::kFloat ? run<float>(xc, jobs, path)
                                       : run<c10::BFloat16>(xc, jobs, path);
}

}  // namespace

bool gguf_supports(int64_t type) {
  TypeInfo info;
  return type_info(type, &info);
}

int64_t gguf_repacked_type(int64_t type) {
  switch (type) {
    case kQ4_K: return kQ4_Kx8;
    case kQ6_K: return kQ6_Kx8;
    case kIQ4_NL: return kIQ4_NLx8;
    case kMXFP4: return kMXFP4x8;
    default: return 0;
  }
}

// Rows `order` (int64, output order; empty: all in order) of a [N, row bytes] part of GGML type
// `type` with K inputs, 8 at a time interleaved into the type's x8 layout, written to `out`:
// uint8 [rows / 8, K / block * 8 * block bytes], contiguous (kvserve.weight_arena's memory, on
// huge pages). The same bytes, and gguf_linear gives the same bits. Returns `out`.
at::Tensor gguf_repack(const at::Tensor& part, int64_t type, int64_t K, const at::Tensor& order,
                       at::Tensor out) {
  kvs::check_cpu("gguf_repack", part, order);
  kvs::check_cpu("gguf_repack", out);
  check_part("gguf_repack", part, type, K);
  const int64_t x8 = gguf_repacked_type(type);
  TORCH_CHECK(x8 != 0, "gguf_repack: GGML type ", type, " has no interleaved layout");
  const int64_t n = order.numel() ? order.numel() : part.size(0);
  TORCH_CHECK(n % 8 == 0, "gguf_repack: ", n, " rows is not a multiple of 8");
  const int64_t* ord = check_order("gguf_repack", order, part.size(0));
  TypeInfo info, out_info;
  type_info(type, &info);
  type_info(x8, &out_info);
  const int64_t blocks = K / info.block;
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == n / 8 && out.size(1) == blocks * out_info.bytes,
              "gguf_repack: out must be contiguous uint8 [", n / 8, ", ", blocks * out_info.bytes,
              "]");
  const auto* base = static_cast<const uint8_t*>(part.data_ptr());
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / 8, 16, [&](int64_t begin, int64_t end) {
    const uint8_t* src[8];
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < blocks; ++b) {
        for (int r = 0; r < 8; ++r)
          src[r] = base + (ord ? ord[8 * g + r] : 8 * g + r) * part.stride(0) + b * info.bytes;
        uint8_t* dst = op + g * out.stride(0) + b * out_info.bytes;
        if (type == kQ4_K)
          x8_pack<kQ4_K>(src, dst);
        else if (type == kMXFP4)
          x8_pack<kMXFP4>(src, dst);
        else if (type == kIQ4_NL)
          x8_pack<kIQ4_NL>(src, dst);
        else
          x8_pack<kQ6_K>(src, dst);
      }
  });
  return out;
}

std::string gguf_path() { return path_name(best_path()); }

std::vector<std::string> gguf_paths() {
  std::vector<std::string> out;
  for (Path p : {Path::kVnni, Path::kAvx2, Path::kPortable})
    if (p <= best_path()) out.emplace_back(path_name(p));
  return out;
}

// x [M, K] float32 or bf16 times the row-concatenation of `parts` (each [N_p, row bytes], the
// file's blocks of GGML type types[p]; rows[p] an int64 [N_p] of the rows to take, in output
// order, or empty for all in order) -> [M, sum N_p] in x's dtype. `path` names one of
// gguf_paths() (the portable one is the plain C++ reference the others are tested against),
// or is empty for the best.
at::Tensor gguf_linear(const at::Tensor& x, const std::vector<at::Tensor>& parts,
                       const std::vector<int64_t>& types, const std::vector<at::Tensor>& rows,
                       const std::string& path_name) {
  const Path path = parse_path(path_name);
  check_x("gguf_linear", x);
  const GGUFMatrix w{parts, types, rows};
  check_matrix("gguf_linear", w, x.size(1));
  return run_jobs(x, {Job{&w, 0, x.size(0)}}, path);
}

// x [M, K] float32 or bf16, its rows offsets[e] .. offsets[e + 1] - 1 times matrix e (each as
// gguf_linear takes one; all with the same outputs N) -> [M, N] in x's dtype: the experts of a
// mixture, each on the rows routed to it, in one call (one quantization of x, one pool of
// work over every expert's rows). A matrix with no rows is not read. Row m's results are
// gguf_linear's for row m alone against its matrix, bit for bit.
at::Tensor gguf_grouped(const at::Tensor& x, const std::vector<int64_t>& offsets,
                        const std::vector<const GGUFMatrix*>& mats, const std::string& path_name) {
  const Path path = parse_path(path_name);
  check_x("gguf_grouped", x);
  TORCH_CHECK(offsets.size() == mats.size() + 1 && !mats.empty() && offsets.front() == 0 &&
                  offsets.back() == x.size(0),
              "gguf_grouped: offsets must be [0, ..., M], one more than the matrices");
  std::vector<Job> jobs;
  for (size_t e = 0; e < mats.size(); ++e) {
    TORCH_CHECK(offsets[e] <= offsets[e + 1], "gguf_grouped: offsets must not decrease");
    if (offsets[e] == offsets[e + 1]) continue;
    check_matrix("gguf_grouped", *mats[e], x.size(1));
    jobs.push_back({mats[e], offsets[e], offsets[e + 1]});
  }
  if (jobs.empty()) return at::empty({0, 0}, x.options());
  return run_jobs(x, jobs, path);
}

// Rows `ids` of a [N, row bytes] part of GGML type `type` with K inputs, dequantized into
// `dtype` (float32, or bf16 rounded from gguf's float32).
at::Tensor gguf_rows(const at::Tensor& part, int64_t type, int64_t K, const at::Tensor& ids,
                     at::ScalarType dtype) {
  kvs::check_cpu("gguf_rows", part, ids);
  check_part("gguf_rows", part, type, K);
  TORCH_CHECK(type < kX8, "gguf_rows: the file's layouts only, not an interleaved one");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "gguf_rows: ids int64 [T]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "gguf_rows: float32 or bf16");
  TypeInfo info;
  type_info(type, &info);
  auto idc = ids.contiguous();
  const int64_t T = idc.numel(), N = part.size(0);
  const auto* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "gguf_rows: id ", ip[t], " out of range [0, ", N, ")");
  auto out = at::empty({T, K}, at::kFloat);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto* w = static_cast<const uint8_t*>(part.data_ptr()) + ip[t] * part.stride(0);
      for (int64_t b = 0; b < K / info.block; ++b)
        dequant_block(type, w + b * info.bytes, op + t * K + b * info.block);
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}
