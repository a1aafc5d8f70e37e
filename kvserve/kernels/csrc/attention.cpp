// paged_attention: every query row of a step attends to its sequence's context, read through
// the sequence's block table from the paged cache, with one arithmetic for every row: a
// decode token, a speculative draft being verified and a prompt chunk's token are the same
// case (a row at position p sees keys 0 .. p), so a row's output does not depend on how its
// prompt was chunked, on what else is in the step, or on where its K/V came from.
//
// q [T, H, D] (float32 or bf16; rows may be strided), cache [2, Hkv, slots, W]: K then V,
// in q's dtype (W = D), int8 rows with a float16 scale after them (W = D + 2, see
// attention/kv_quant.py), or, under float32 q on AVX2, float16 or bf16 (W = D): widened
// exactly as they are read (F16C's vcvtph2ps; a shift for bf16), so a row's result is bit
// for bit the float32 kernel's on a cache holding the same values in float32. seqs [S, 3]
// int64: (first row in q, rows, context length), the rows being the sequence's last
// positions; tables [S, nb] int64 block ids. Query heads h * G .. h * G + G - 1 share KV
// head h.
//
// A row's arithmetic, in float32 (a "unit" is 32 bits: one float32 value, or a pair of bf16):
//   scores: one accumulator lane per key, summed over the head dimension in order, a unit at
//     a time (fmadd, or dpbf16 for a pair of dimensions); the scale is applied after;
//   e_j = exp(s_j * scale - max * scale), summed in 16 lanes (key j in lane j mod 16), then
//     across; P = e in the compute dtype (bf16: rounded);
//   P.V: one accumulator lane per output dimension, summed over the keys in order (bf16: a
//     pair of consecutive keys per dpbf16); times 1 / sum.
// Keys past a row's position and past the context enter as exact zeros, so the number of
// 16-key tiles a row block spans does not change a row's result. With a sliding window W (a
// local layer), a row at position p sees keys p - W + 1 .. p: the keys before enter as exact
// zeros too, and whole tiles of them are skipped, which changes nothing either.
//
// Those sums run down register lanes when K is laid out as [unit][16 keys] per tile and V
// (bf16) as pairs of keys interleaved. A long chunk has K and V repacked that way once per
// step, in parallel, and shared by its work items ("packed"). A short sequence (a decode, a
// verification) is one work item per KV head that transposes K and interleaves V in
// registers straight from the cache ("direct"): handing a freshly written buffer to another
// core costs more than the packing saves for a handful of rows. Both paths make the same
// multiply-adds in the same order for every lane.
#include "common.h"

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTile = 16;  // keys per tile: the 16 lanes of one register of scores

struct Seq {
  int64_t first, rows, len;  // first row in q, rows (the last positions), context length
  const int64_t* table;
  int64_t t0;  // the first tile any of its rows sees (0 but with a sliding window)
  int64_t tiles() const { return (len + kTile - 1) / kTile; }
  int64_t held() const { return tiles() - t0; }  // tiles a packed copy holds
};

#if defined(__AVX512F__) || defined(KVS_AVX2)
// Query rows computed together, an accumulator each (AVX2's 16 registers hold 6 of two).
constexpr int kRowBlock = kvs::kAvx512 ? 12 : 6;
constexpr int64_t kDirectRows = 8;     // sequences with at most this many rows go direct
constexpr int64_t kItemPositions = 4;  // query positions per work item of a packed chunk

// Where a work item's K and V come from: a packed copy of tiles t0 .. (kpk [tiles][U][16],
// vpk [tiles * 16 / per][D] units), or the cache rows themselves (krows / vrows: a pointer
// per position; those before tile t0 unused).
struct Context {
  const uint32_t* kpk;
  const uint32_t* vpk;
  const uint32_t* const* krows;
  const uint32_t* const* vrows;
  int64_t len;
  int64_t t0;
};

inline void prefetch_rows(const uint32_t* const* rows, int64_t from, int64_t to,
                          int64_t bytes) {
  for (int64_t t = from; t < to; ++t)
    for (int64_t i = 0; i < bytes; i += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[t]) + i, _MM_HINT_T0);
}

// An attention sink's term of a row's softmax denominator: exp(sink - shift), with the shift
// taken over the row's scaled scores and the sink; exactly 0 for none (-inf), which leaves a
// row without a sink the bits it had before sinks existed. The same vector exp as the keys'.
inline float sink_share(float sink, float shift) {
  if (sink == -INFINITY) return 0.f;
#if defined(__AVX512F__)
  return _mm512_cvtss_f32(kvs::exp_ps(_mm512_set1_ps(sink - shift)));
#else
  return _mm256_cvtss_f32(kvs::exp8_ps(_mm256_set1_ps(sink - shift)));
#endif
}

// Each instruction set's pieces of a row block (below): the scores of NR rows for tile kt,
// into sc[r] + 16 kt; one row's softmax over keys first .. n - 1 into P (pb, by absolute
// key), returning 1 / sum. KV is the type of the cache rows a direct row block reads (T, or
// a 16-bit type under float32 T: AVX2 only); packed copies hold T.
template <typename T, typename KV, int NR, bool Direct>
inline void scores_tile(const uint32_t* const* q, const Context& c, int64_t kt, int64_t U,
                        float* const* sc);
template <typename T>
inline float softmax_row(const float* s, int64_t first, int64_t n, int64_t t_lo, int64_t tiles,
                         float scale, float sink, uint32_t* pb);

// The first half of a row block: the tiles t_lo .. tiles - 1 its rows see, their scores and
// each row's P and 1 / sum (inv). Returns {t_lo, tiles}.
template <typename T, typename KV, int NR, bool Direct>
inline std::pair<int64_t, int64_t> score_rows(const uint32_t* const* q, const int64_t* first,
                                              const int64_t* nkeys, float* const* sc,
                                              uint32_t* const* pb, const Context& c, int64_t D,
                                              float scale, const float* sink, float* inv) {
  int64_t most = 0, least = nkeys[0];
  for (int r = 0; r < NR; ++r) {
    most = std::max(most, nkeys[r]);
    least = std::min(least, first[r]);
  }
  const int64_t tiles = (most + kTile - 1) / kTile, t_lo = least / kTile;
  for (int64_t t = t_lo; t < tiles; ++t)
    scores_tile<T, KV, NR, Direct>(q, c, t, D / kvs::kPer<T>, sc);
  for (int r = 0; r < NR; ++r)
    inv[r] = softmax_row<T>(sc[r], first[r], nkeys[r], t_lo, tiles, scale, sink[r], pb[r]);
  return {t_lo, tiles};
}

// A row block, row_block<T, KV, NR, Direct> of each instruction set.
template <typename T>
using RowBlockFn = void (*)(const uint32_t* const*, const int64_t*, const int64_t*,
                            float* const*, uint32_t* const*, const Context&, int64_t, float,
                            const float*, T* const*);
#endif

#if defined(__AVX512F__)
// The scores of NR rows for tile kt, into sc[r] + 16 kt.
template <typename T, typename KV, int NR, bool Direct>
inline void scores_tile(const uint32_t* const* q, const Context& c, int64_t kt, int64_t U,
                        float* const* sc) {
  static_assert(std::is_same_v<KV, T>, "the AVX-512 kernel reads K/V in the compute dtype");
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  if (!Direct || U % 16) {
    const uint32_t* kt_units;
    alignas(64) uint32_t local[16 * 128];  // only bf16 with U % 16 == 8 comes here: U < 128
    if (!Direct) {
      kt_units = c.kpk + (kt - c.t0) * U * kTile;
    } else {
      for (int64_t u = 0; u < U; ++u)
        for (int64_t j = 0; j < 16; ++j) {
          const int64_t t = kt * kTile + j;
          local[u * 16 + j] = t < c.len ? c.krows[t][u] : 0;
        }
      kt_units = local;
    }
    for (int64_t u = 0; u < U; ++u) {
      const __m512i k = _mm512_loadu_si512(kt_units + u * kTile);
      for (int r = 0; r < NR; ++r) acc[r] = kvs::fma_unit<T>(acc[r], q[r] + u, k);
    }
  } else {
    // Direct: 16 units of the tile's 16 keys transposed in registers, then consumed.
    if (kt * kTile + 2 * kTile < c.len)
      prefetch_rows(c.krows, kt * kTile + 2 * kTile,
                    std::min(c.len, kt * kTile + 3 * kTile), U * 4);
    for (int64_t u0 = 0; u0 < U; u0 += 16) {
      __m512i k[16];
      for (int j = 0; j < 16; ++j) {
        const int64_t t = kt * kTile + j;
        k[j] = t < c.len ? _mm512_loadu_si512(c.krows[t] + u0) : _mm512_setzero_si512();
      }
      kvs::transpose16(k);
      for (int i = 0; i < 16; ++i)
        for (int r = 0; r < NR; ++r) acc[r] = kvs::fma_unit<T>(acc[r], q[r] + u0 + i, k[i]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(sc[r] + kt * kTile, acc[r]);
}

// Lanes of tile t holding keys first .. n - 1.
inline __mmask16 live_keys(int64_t t, int64_t first, int64_t n) {
  const int64_t lo = std::clamp<int64_t>(first - t * kTile, 0, kTile);
  const int64_t hi = std::clamp<int64_t>(n - t * kTile, 0, kTile);
  return static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
}

// The softmax of one row's keys first .. n - 1 over tiles t_lo .. tiles - 1 of scores, into P
// (pb, by absolute key); returns 1 / sum.
template <typename T>
inline float softmax_row(const float* s, int64_t first, int64_t n, int64_t t_lo, int64_t tiles,
                         float scale, float sink, uint32_t* pb) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t t = first / kTile; t * kTile < n; ++t) {
    const __mmask16 live = live_keys(t, first, n);
    top = _mm512_mask_max_ps(top, live, top, _mm512_maskz_loadu_ps(live, s + t * kTile));
  }
  const float top_scaled = std::max(_mm512_reduce_max_ps(top) * scale, sink);
  const __m512 shift = _mm512_set1_ps(top_scaled);
  const __m512 sc16 = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = t_lo; t < tiles; ++t) {
    const __mmask16 live = live_keys(t, first, n);
    const __m512 e = _mm512_maskz_mov_ps(
        live, kvs::exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s + t * kTile), sc16, shift)));
    sum = _mm512_add_ps(sum, e);
    if constexpr (kvs::kPer<T> == 1) {
      _mm512_storeu_ps(reinterpret_cast<float*>(pb) + t * kTile, e);
    } else {
#if defined(__AVX512BF16__)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(pb) +
                                                     t * kTile),
                          (__m256i)_mm512_cvtneps_pbh(e));
#endif
    }
  }
  return 1.f / (_mm512_reduce_add_ps(sum) + sink_share(sink, top_scaled));
}

// Dimensions d0 .. d0 + 15 of V rows as P.V consumes them: float32, row a's values; bf16,
// units holding row a's value (low half) and row b's (high half). nullptr reads as zeros.
template <typename T>
inline __m512i v_units(const uint32_t* a, const uint32_t* b, int64_t d0) {
  if constexpr (kvs::kPer<T> == 1) {
    return a ? _mm512_loadu_si512(a + d0) : _mm512_setzero_si512();
  } else {
    const auto load = [d0](const uint32_t* row) {
      return row ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                       reinterpret_cast<const uint16_t*>(row) + d0))
                 : _mm256_setzero_si256();
    };
    return _mm512_or_si512(_mm512_cvtepu16_epi32(load(a)),
                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(load(b)), 16));
  }
}

// V unit j of the context (a key; bf16: keys 2j and 2j + 1), dimensions d0 .. d0 + 15.
template <typename T, bool Direct>
inline __m512i v_unit(const Context& c, int64_t j, int64_t d0, int64_t D) {
  constexpr int64_t per = kvs::kPer<T>;
  if constexpr (!Direct) return _mm512_loadu_si512(c.vpk + (j - c.t0 * kTile / per) * D + d0);
  const int64_t t = j * per;
  return v_units<T>(t < c.len ? c.vrows[t] : nullptr,
                    per == 2 && t + 1 < c.len ? c.vrows[t + 1] : nullptr, d0);
}

// NR rows of one KV head; row r sees keys first[r] .. nkeys[r] - 1. sc and pb: per row,
// room for the scores and P of every tile (indexed by absolute key).
template <typename T, typename KV, int NR, bool Direct>
void row_block(const uint32_t* const* q, const int64_t* first, const int64_t* nkeys,
               float* const* sc, uint32_t* const* pb, const Context& c, int64_t D, float scale,
               const float* sink, T* const* out) {
  static_assert(std::is_same_v<KV, T>, "the AVX-512 kernel reads K/V in the compute dtype");
  constexpr int64_t per = kvs::kPer<T>;
  float inv[NR];
  const auto [t_lo, tiles] =
      score_rows<T, KV, NR, Direct>(q, first, nkeys, sc, pb, c, D, scale, sink, inv);
  const int64_t vunits = tiles * kTile / per, tile_units = kTile / per;
  constexpr bool fetch = Direct;  // V rows 2 tiles ahead, on the first pass
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t j = t_lo * tile_units; j < vunits; ++j) {
      if (fetch && d0 == 0 && j % tile_units == 0) {
        const int64_t ahead = (j / tile_units + 2) * kTile;
        if (ahead < c.len)
          prefetch_rows(c.vrows, ahead, std::min(c.len, ahead + kTile), D * sizeof(T));
      }
      const __m512i v = v_unit<T, Direct>(c, j, d0, D);
      for (int r = 0; r < NR; ++r) acc[r] = kvs::fma_unit<T>(acc[r], pb[r] + j, v);
    }
    for (int r = 0; r < NR; ++r)
      kvs::store16(out[r] + d0, _mm512_mul_ps(acc[r], _mm512_set1_ps(inv[r])));
  }
}

template <typename T, typename KV, bool Direct>
constexpr RowBlockFn<T> kRowBlocks[kRowBlock] = {
    row_block<T, KV, 1, Direct>,  row_block<T, KV, 2, Direct>,  row_block<T, KV, 3, Direct>,
    row_block<T, KV, 4, Direct>,  row_block<T, KV, 5, Direct>,  row_block<T, KV, 6, Direct>,
    row_block<T, KV, 7, Direct>,  row_block<T, KV, 8, Direct>,  row_block<T, KV, 9, Direct>,
    row_block<T, KV, 10, Direct>, row_block<T, KV, 11, Direct>, row_block<T, KV, 12, Direct>};

// The 16 K rows of a tile (nullptr past the context) -> [U][16]: unit u of key j at 16u + j.
template <typename KV>
inline void pack_k(const uint32_t* const* rows, int64_t U, uint32_t* dst) {
  static_assert(sizeof(KV) == 4 || sizeof(KV) == 2, "rows of units");  // T: float32 or bf16
  int64_t u0 = 0;
  for (; u0 + 16 <= U; u0 += 16) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j)
      r[j] = rows[j] ? _mm512_loadu_si512(rows[j] + u0) : _mm512_setzero_si512();
    kvs::transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (u0 + i) * 16, r[i]);
  }
  for (; u0 < U; ++u0)
    for (int j = 0; j < 16; ++j) dst[u0 * 16 + j] = rows[j] ? rows[j][u0] : 0;
}

// The 16 V rows of a tile -> [16 / per][D] units: float32 rows as they are; bf16 dimension d
// of keys 2i (low half) and 2i + 1 (high half) in unit (i, d), as v_unit builds them.
template <typename T, typename KV>
inline void pack_v(const uint32_t* const* rows, int64_t D, uint32_t* dst) {
  static_assert(std::is_same_v<KV, T>, "the AVX-512 kernel reads K/V in the compute dtype");
  constexpr int64_t per = kvs::kPer<T>;
  for (int64_t j = 0; j < kTile / per; ++j)
    for (int64_t d0 = 0; d0 < D; d0 += 16)
      _mm512_storeu_si512(dst + j * D + d0,
                          v_units<T>(rows[j * per], per == 2 ? rows[j * per + 1] : nullptr, d0));
}

#elif defined(KVS_AVX2)
// AVX2 (float32 activations): a tile's 16 lanes are two 8-lane registers, lo (keys or
// dimensions 0..7) and hi (8..15); every lane's sum runs in the order described at the top.
// K/V rows may be stored as float32 (KV = float), float16 (c10::Half) or bf16
// (c10::BFloat16): every load widens them to float32 exactly, so the arithmetic after it is
// the same whatever KV is.
struct F16 {
  __m256 lo, hi;
};
inline F16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }

// 8 stored values from p, as float32: exact for each KV (float16 and bf16 are subsets of
// float32).
template <typename KV>
inline __m256 load8(const KV* p) {
  return kvs::widen8(p);
}
template <typename KV>
inline F16 load16(const KV* p) {
  return {load8(p), load8(p + 8)};
}
inline void store16(float* p, F16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline F16 fma16(float a, F16 b, F16 acc) {
  const __m256 s = _mm256_set1_ps(a);
  return {_mm256_fmadd_ps(s, b.lo, acc.lo), _mm256_fmadd_ps(s, b.hi, acc.hi)};
}

// Units u0 .. u0 + 7 of the 16 keys rows[0..15] (nullptr: zeros) -> dst[i * 16 + j] = unit
// u0 + i of key j, as float32: two 8 x 8 transposes.
template <typename KV>
inline void transpose_keys(const KV* const* rows, int64_t u0, float* dst) {
  for (int h = 0; h < 2; ++h) {
    __m256 r[8];
    for (int j = 0; j < 8; ++j)
      r[j] = rows[8 * h + j] ? load8(rows[8 * h + j] + u0) : _mm256_setzero_ps();
    kvs::transpose8(r);
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + i * 16 + 8 * h, r[i]);
  }
}

template <typename T, typename KV, int NR, bool Direct>
inline void scores_tile(const uint32_t* const* q, const Context& c, int64_t kt, int64_t U,
                        float* const* sc) {
  static_assert(std::is_same_v<T, float>, "the AVX2 kernel is float32 only");
  F16 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = zero16();
  const auto qf = [q](int r, int64_t u) { return reinterpret_cast<const float*>(q[r])[u]; };
  if (!Direct) {
    const auto* k = reinterpret_cast<const float*>(c.kpk) + (kt - c.t0) * U * kTile;
    for (int64_t u = 0; u < U; ++u) {
      const F16 kv = load16(k + u * kTile);
      for (int r = 0; r < NR; ++r) acc[r] = fma16(qf(r, u), kv, acc[r]);
    }
  } else {
    if (kt * kTile + 2 * kTile < c.len)
      prefetch_rows(c.krows, kt * kTile + 2 * kTile,
                    std::min(c.len, kt * kTile + 3 * kTile), U * sizeof(KV));
    const KV* rows[16];
    for (int j = 0; j < 16; ++j) {
      const int64_t t = kt * kTile + j;
      rows[j] = t < c.len ? reinterpret_cast<const KV*>(c.krows[t]) : nullptr;
    }
    alignas(32) float local[8 * 16];
    for (int64_t u0 = 0; u0 < U; u0 += 8) {
      transpose_keys(rows, u0, local);
      for (int i = 0; i < 8; ++i) {
        const F16 kv = load16(local + i * kTile);
        for (int r = 0; r < NR; ++r) acc[r] = fma16(qf(r, u0 + i), kv, acc[r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) store16(sc[r] + kt * kTile, acc[r]);
}

// All-ones lanes where key base + i is in first .. n - 1.
inline __m256 live8(int64_t base, int64_t first, int64_t n) {
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(base)),
                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i ge = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(static_cast<int>(first) - 1));
  const __m256i lt = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx);
  return _mm256_castsi256_ps(_mm256_and_si256(ge, lt));
}

template <typename T>
inline float softmax_row(const float* s, int64_t first, int64_t n, int64_t t_lo, int64_t tiles,
                         float scale, float sink, uint32_t* pb) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 top = ninf;
  for (int64_t t = first / kTile; t * kTile < n; ++t)
    for (int h = 0; h < 2; ++h)
      top = _mm256_max_ps(top, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + t * kTile + 8 * h),
                                                live8(t * kTile + 8 * h, first, n)));
  const float top_scaled = std::max(kvs::hmax8_ps(top) * scale, sink);
  const __m256 shift = _mm256_set1_ps(top_scaled);
  const __m256 sc8 = _mm256_set1_ps(scale);
  __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  auto* p = reinterpret_cast<float*>(pb);
  for (int64_t t = t_lo; t < tiles; ++t) {
    for (int h = 0; h < 2; ++h) {
      const int64_t k0 = t * kTile + 8 * h;
      const __m256 e = _mm256_and_ps(
          live8(k0, first, n), kvs::exp8_ps(_mm256_fmsub_ps(_mm256_loadu_ps(s + k0), sc8, shift)));
      sum[h] = _mm256_add_ps(sum[h], e);
      _mm256_storeu_ps(p + k0, e);
    }
  }
  return 1.f / (kvs::hsum8_ps(_mm256_add_ps(sum[0], sum[1])) + sink_share(sink, top_scaled));
}

template <typename T, typename KV, int NR, bool Direct>
void row_block(const uint32_t* const* q, const int64_t* first, const int64_t* nkeys,
               float* const* sc, uint32_t* const* pb, const Context& c, int64_t D, float scale,
               const float* sink, T* const* out) {
  static_assert(std::is_same_v<T, float>, "the AVX2 kernel is float32 only");
  float inv[NR];
  const auto [t_lo, tiles] =
      score_rows<T, KV, NR, Direct>(q, first, nkeys, sc, pb, c, D, scale, sink, inv);
  const F16 zeros = zero16();
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    F16 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = zero16();
    for (int64_t j = t_lo * kTile; j < tiles * kTile; ++j) {
      if (Direct && d0 == 0 && j % kTile == 0) {
        const int64_t ahead = j + 2 * kTile;
        if (ahead < c.len)
          prefetch_rows(c.vrows, ahead, std::min(c.len, ahead + kTile), D * sizeof(KV));
      }
      const F16 v = !Direct ? load16(reinterpret_cast<const float*>(c.vpk) +
                                     (j - c.t0 * kTile) * D + d0)
                    : j < c.len ? load16(reinterpret_cast<const KV*>(c.vrows[j]) + d0)
                                : zeros;
      for (int r = 0; r < NR; ++r)
        acc[r] = fma16(reinterpret_cast<const float*>(pb[r])[j], v, acc[r]);
    }
    for (int r = 0; r < NR; ++r) {
      const __m256 s = _mm256_set1_ps(inv[r]);
      store16(out[r] + d0, {_mm256_mul_ps(acc[r].lo, s), _mm256_mul_ps(acc[r].hi, s)});
    }
  }
}

template <typename T, typename KV, bool Direct>
constexpr RowBlockFn<T> kRowBlocks[kRowBlock] = {
    row_block<T, KV, 1, Direct>, row_block<T, KV, 2, Direct>, row_block<T, KV, 3, Direct>,
    row_block<T, KV, 4, Direct>, row_block<T, KV, 5, Direct>, row_block<T, KV, 6, Direct>};

// Packed copies hold float32 whatever KV is: rows are widened once, as they are packed.
template <typename KV>
inline void pack_k(const uint32_t* const* rows, int64_t U, uint32_t* dst) {
  const auto* const* s = reinterpret_cast<const KV* const*>(rows);
  for (int64_t u0 = 0; u0 < U; u0 += 8)
    transpose_keys(s, u0, reinterpret_cast<float*>(dst) + u0 * kTile);
}

template <typename T, typename KV>
inline void pack_v(const uint32_t* const* rows, int64_t D, uint32_t* dst) {
  auto* f = reinterpret_cast<float*>(dst);
  for (int64_t j = 0; j < kTile; ++j) {
    if (!rows[j]) {
      std::memset(f + j * D, 0, D * sizeof(float));
    } else if constexpr (std::is_same_v<KV, float>) {
      std::memcpy(f + j * D, rows[j], D * sizeof(float));
    } else {
      const auto* r = reinterpret_cast<const KV*>(rows[j]);
      for (int64_t d0 = 0; d0 < D; d0 += 8) _mm256_storeu_ps(f + j * D + d0, load8(r + d0));
    }
  }
}
#endif

#if defined(__AVX512F__) || defined(KVS_AVX2)

// Rows of the cache as the kernel reads them: in place (KV values: T, or 16-bit values the
// loads widen), or dequantized from int8 into `into` (KV = T) exactly as
// attention/kv_quant.py's dequantize_int8 does (value * scale in float32, then rounded to
// the compute dtype).
template <typename T, typename KV>
struct CacheRows {
  const uint8_t* base;
  int64_t hkv, slots, width_bytes, D, block_size;
  bool int8;

  // K (kv = 0) or V (kv = 1) of KV head g for position t of the sequence with `table`.
  const uint32_t* row(int kv, int64_t g, const int64_t* table, int64_t t, T* into) const {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    const uint8_t* p = base + ((kv * hkv + g) * slots + slot) * width_bytes;
    if (!int8) return reinterpret_cast<const uint32_t*>(p);
    const auto* qv = reinterpret_cast<const int8_t*>(p);
    uint16_t bits;
    std::memcpy(&bits, p + D, sizeof bits);
    const float s = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
    for (int64_t d = 0; d < D; ++d) into[d] = static_cast<T>(static_cast<float>(qv[d]) * s);
    return reinterpret_cast<const uint32_t*>(into);
  }

  // Tile kt of KV head g of a sequence of `len` positions, packed into kdst and vdst.
  void pack_tile(int64_t g, const int64_t* table, int64_t len, int64_t kt, uint32_t* kdst,
                 uint32_t* vdst, T* scratch) const {
    const uint32_t* rows[16];
    for (int kv = 0; kv < 2; ++kv) {
      for (int j = 0; j < 16; ++j) {
        const int64_t t = kt * kTile + j;
        rows[j] = t < len ? row(kv, g, table, t, scratch + j * D) : nullptr;
      }
      if (kv == 0)
        pack_k<KV>(rows, D / kvs::kPer<T>, kdst);
      else
        pack_v<T, KV>(rows, D, vdst);
    }
  }
};

struct Item {
  int64_t seq, g, r0, nr;  // rows r0 .. r0 + nr - 1 of KV head g: position r / G, head r % G
};

// KV: how the cache holds K/V rows (see CacheRows); T for an int8 cache.
template <typename T, typename KV>
void attend(const at::Tensor& q, const at::Tensor& cache, const std::vector<Seq>& seqs,
            int64_t block_size, int64_t window, float scale, const float* sinks,
            at::Tensor& out) {
  constexpr int64_t per = kvs::kPer<T>;
  const int64_t H = q.size(1), D = q.size(2), Hkv = cache.size(1), G = H / Hkv;
  const int64_t U = D / per, tile_units = 2 * kTile * D / per, qstride = q.stride(0);
  const int64_t S = static_cast<int64_t>(seqs.size());
  const CacheRows<T, KV> rows{static_cast<const uint8_t*>(cache.data_ptr()), Hkv,
                              cache.size(2), cache.size(3) * cache.element_size(), D,
                              block_size, cache.scalar_type() == at::kChar};
  const int threads = at::get_num_threads();
  // Packed: long chunks; sequences of an int8 cache, whose rows must be dequantized once;
  // and every sequence when there are fewer (sequence, KV head) pairs than threads.
  const bool few = S * Hkv < threads;
  std::vector<int64_t> offset(S, -1);
  std::vector<std::pair<int64_t, int64_t>> pack_jobs;  // (sequence, its first job)
  int64_t packed_units = 0, jobs = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (few || rows.int8 || seqs[s].rows > kDirectRows) {
      offset[s] = packed_units;
      packed_units += Hkv * seqs[s].held() * tile_units;
      pack_jobs.emplace_back(s, jobs);
      jobs += Hkv * seqs[s].held();
    }
  }
  // Reused across calls (by the calling thread): a fresh allocation of this size is mapped
  // anew each time, and its page faults cost more than the packing.
  static thread_local std::vector<uint32_t> packed_buffer;
  if (static_cast<int64_t>(packed_buffer.size()) < packed_units)
    packed_buffer.resize(packed_units);
  uint32_t* packed = packed_buffer.data();  // the worker threads' view of it
  if (jobs) {
    at::parallel_for(0, jobs, 4, [&](int64_t begin, int64_t end) {
      std::vector<T> scratch(16 * D);
      for (int64_t job = begin; job < end; ++job) {
        const auto it = std::upper_bound(pack_jobs.begin(), pack_jobs.end(), job,
                                         [](int64_t j, const auto& p) { return j < p.second; }) -
                        1;
        const Seq& sq = seqs[it->first];
        const int64_t local = job - it->second, g = local / sq.held(), i = local % sq.held();
        uint32_t* base = packed + offset[it->first] + g * sq.held() * tile_units;
        rows.pack_tile(g, sq.table, sq.len, sq.t0 + i, base + i * U * kTile,
                       base + sq.held() * U * kTile + i * (kTile / per) * D, scratch.data());
      }
    });
  }
  // Work items: a direct sequence's rows per KV head; a packed sequence's in pieces of
  // kItemPositions positions (all heads of the KV head), fewer when that leaves threads idle.
  int64_t chunk = kItemPositions * G;
  const auto count = [&](int64_t c) {
    int64_t n = 0;
    for (int64_t s = 0; s < S; ++s)
      n += Hkv * (offset[s] >= 0 ? (seqs[s].rows * G + c - 1) / c : 1);
    return n;
  };
  while (chunk > 1 && count(chunk) < 2 * threads) chunk = (chunk + 1) / 2;
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t nrows = seqs[s].rows * G;
    const int64_t step = offset[s] >= 0 ? chunk : nrows;
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t r0 = 0; r0 < nrows; r0 += step)
        items.push_back({s, g, r0, std::min(step, nrows - r0)});
  }
  // The costliest first (a chunk's last rows see the most keys), so uneven items balance.
  const auto cost = [&](const Item& it) {
    const Seq& sq = seqs[it.seq];
    const int64_t seen = sq.len - sq.rows + (it.r0 + it.nr) / G;
    return (window ? std::min(seen, window) : seen) * it.nr;
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  const auto* qp = static_cast<const T*>(q.data_ptr());
  T* op = out.data_ptr<T>();
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // Per-thread buffers that outlive the call (the pool's threads persist): allocating them
    // per call cost more than a short decode's attention.
    static thread_local std::vector<float> scores;
    static thread_local std::vector<uint32_t> probs;
    static thread_local std::vector<const uint32_t*> krows, vrows;
    for (int64_t i; (i = next.fetch_add(1)) < n_items;) {
      const Item& it = items[i];
      const Seq& sq = seqs[it.seq];
      const int64_t tiles = sq.tiles();
      Context ctx{nullptr, nullptr, nullptr, nullptr, sq.len, sq.t0};
      if (offset[it.seq] >= 0) {
        ctx.kpk = packed + offset[it.seq] + it.g * sq.held() * tile_units;
        ctx.vpk = ctx.kpk + sq.held() * U * kTile;
      } else {
        krows.resize(sq.len);
        vrows.resize(sq.len);
        for (int64_t t = sq.t0 * kTile; t < sq.len; ++t) {
          krows[t] = rows.row(0, it.g, sq.table, t, nullptr);
          vrows[t] = rows.row(1, it.g, sq.table, t, nullptr);
        }
        ctx.krows = krows.data();
        ctx.vrows = vrows.data();
      }
      scores.resize(std::min<int64_t>(it.nr, kRowBlock) * tiles * kTile);
      probs.resize(scores.size());
      // Near-equal row blocks of at most kRowBlock rows.
      const int64_t blocks = (it.nr + kRowBlock - 1) / kRowBlock;
      for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
        const int64_t nr = (it.nr - r0) / (blocks - b);
        const uint32_t* qrows[kRowBlock];
        float* sc[kRowBlock];
        uint32_t* pb[kRowBlock];
        int64_t nkeys[kRowBlock], first[kRowBlock];
        float sink[kRowBlock];
        T* orows[kRowBlock];
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t row = it.r0 + r0 + r, pos = row / G, h = it.g * G + row % G;
          qrows[r] = reinterpret_cast<const uint32_t*>(qp + (sq.first + pos) * qstride + h * D);
          sc[r] = scores.data() + r * tiles * kTile;
          pb[r] = probs.data() + r * tiles * kTile;
          nkeys[r] = sq.len - sq.rows + pos + 1;
          first[r] = window ? std::max<int64_t>(0, nkeys[r] - window) : 0;
          sink[r] = sinks != nullptr ? sinks[h] : -INFINITY;
          orows[r] = op + ((sq.first + pos) * H + h) * D;
        }
        (ctx.kpk != nullptr ? kRowBlocks<T, T, false> : kRowBlocks<T, KV, true>)[nr - 1](
            qrows, first, nkeys, sc, pb, ctx, D, scale, sink, orows);
        r0 += nr;
      }
    }
  });
}
#endif

}  // namespace

bool has_paged_attention(at::ScalarType dtype, at::ScalarType kv) {
  if (kv == dtype || kv == at::kChar)
    return dtype == at::kFloat ? kvs::kAvx512 || kvs::kAvx2
                               : dtype == at::kBFloat16 && kvs::kAvx512Bf16;
  // 16-bit K/V under float32 activations: the AVX2 kernel's loads widen them (the AVX-512
  // kernel has no such loads).
  return dtype == at::kFloat && (kv == at::kHalf || kv == at::kBFloat16) && kvs::kAvx2;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& seqs,
                           const at::Tensor& tables, int64_t block_size, double scale,
                           int64_t window, const c10::optional<at::Tensor>& sinks) {
  kvs::check_cpu("paged_attention", q, cache, seqs, tables);
  TORCH_CHECK(has_paged_attention(q.scalar_type(), cache.scalar_type()),
              "paged_attention: no kernel for this dtype and cache dtype on this CPU");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 4 && cache.size(0) == 2, "bad shapes");
  const int64_t D = q.size(2), H = q.size(1), Hkv = cache.size(1);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "q rows must be contiguous heads");
  TORCH_CHECK(cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(D % 16 == 0 && D <= 256, "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(H % Hkv == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  const bool int8 = cache.scalar_type() == at::kChar;
  TORCH_CHECK(cache.size(3) == (int8 ? D + 2 : D),
              "cache rows must be head_dim values, or int8 rows with a scale");
  TORCH_CHECK(seqs.scalar_type() == at::kLong && tables.scalar_type() == at::kLong,
              "seqs and tables must be int64");
  TORCH_CHECK(seqs.dim() == 2 && seqs.size(1) == 3 && tables.dim() == 2 &&
                  tables.size(0) == seqs.size(0), "seqs [S, 3] and tables [S, nb]");
  const auto sq = seqs.contiguous();
  const auto tb = tables.contiguous();
  const int64_t* s = sq.data_ptr<int64_t>();
  const int64_t* t = tb.data_ptr<int64_t>();
  const int64_t S = seqs.size(0), nb = tables.size(1), blocks = cache.size(2) / block_size;
  std::vector<Seq> list;
  list.reserve(S);
  for (int64_t i = 0; i < S; ++i) {
    const int64_t first = s[3 * i], rows = s[3 * i + 1], len = s[3 * i + 2];
    TORCH_CHECK(first >= 0 && rows >= 1 && first + rows <= q.size(0), "rows out of range");
    TORCH_CHECK(len >= rows && len <= nb * block_size, "the table must cover the context");
    for (int64_t j = 0; j < (len + block_size - 1) / block_size; ++j)
      TORCH_CHECK(t[i * nb + j] >= 0 && t[i * nb + j] < blocks, "block id out of range");
    const int64_t t0 = window ? std::max<int64_t>(0, len - rows + 1 - window) / kTile : 0;
    list.push_back({first, rows, len, t + i * nb, t0});
  }
  const float* sink = nullptr;
  at::Tensor sink_values;
  if (sinks.has_value() && sinks->defined() && sinks->numel()) {
    sink_values = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sink_values.dim() == 1 && sink_values.size(0) == H,
                "sinks: one logit per query head");
    sink = sink_values.data_ptr<float>();
  }
  auto out = at::empty({q.size(0), H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const float sc = static_cast<float>(scale);
#if defined(__AVX512F__)
  if (q.scalar_type() == at::kFloat) {
    attend<float, float>(q, cache, list, block_size, window, sc, sink, out);
  } else {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    attend<c10::BFloat16, c10::BFloat16>(q, cache, list, block_size, window, sc, sink, out);
#endif
  }
#elif defined(KVS_AVX2)
  if (cache.scalar_type() == at::kHalf)
    attend<float, c10::Half>(q, cache, list, block_size, window, sc, sink, out);
  else if (cache.scalar_type() == at::kBFloat16)
    attend<float, c10::BFloat16>(q, cache, list, block_size, window, sc, sink, out);
  else
    attend<float, float>(q, cache, list, block_size, window, sc, sink, out);
#endif
  return out;
}
