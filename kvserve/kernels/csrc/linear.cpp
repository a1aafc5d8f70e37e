// x W^T for every weight format, each output computed alone: its sum over the input
// dimension runs in one order in one register lane, whatever the number of rows (batch
// invariance), so there is no separate small-batch path anywhere.
//
// dense_pack / dense_linear: float32 or bf16 weights. The weight is repacked once into tiles
// of 16 outputs, [N / 16][K / per][16 units]: unit u of output j at (u, j), a unit being one
// float32 input or a pair of bf16 inputs (2u, 2u + 1). A microkernel keeps MR rows x NC
// tiles of accumulators in registers and, per unit, broadcasts each row's unit against the
// NC tiles' (fmadd, or dpbf16 for a pair). Work is split over tiles of outputs; the whole
// input dimension is summed in one pass.
//
// bf16 on a CPU with AMX (where the kernel may use its tiles): the same packing is the layout
// AMX's B tiles want (16 pairs of inputs x 16 outputs, 64 bytes a row), and every call of a
// layer whose input dimension is a multiple of 32 runs on AMX instead, whatever its number
// of rows: 3-10x faster than the dpbf16 kernel from 32 rows up, and not slower at one row.
// AMX sums the 32 products of a tile step in its own order (not dpbf16's), so a layer never
// mixes the two; rows are padded to tiles of 16 with zeros, which leave the others alone.
//
// quant_pack / quant_linear: int4 (GGML's Q4_1) or int8 weights in groups of 32, with x
// quantized to int8 per group (GGML's Q8_1) and AVX512-VNNI integer dot products; faster
// than torch's int4/int8 kernels and than the bf16 matmul at every batch size here.
//
// On CPUs with AVX2 but no AVX-512 (KVS_AVX2): dense_linear in float32 and quant_linear (float32
// or bf16 activations) read the same packed layouts with 8-lane registers, each output's sum
// in the same order as above, so they give the AVX-512 kernels' results. There dense_linear
// also reads weights stored in 16 bits (dense_pack_half: bf16 or float16 tiles [N / 16, K,
// 16]) with float32 activations, widened exactly as loaded: the float32 kernel's results on
// the same weight values, from half the bytes (a bf16 checkpoint served in float32).
#include "common.h"

#include <algorithm>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define KVS_AMX 1
#endif

namespace {

#if defined(__AVX512F__)
constexpr int kMR = 8;  // rows per microkernel call
constexpr int kNC = 3;  // tiles of 16 outputs per microkernel call

template <typename T, int MR, int NC>
void dense_block(const uint32_t* const* x, const uint32_t* w, int64_t U, T* const* y) {
  __m512 acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t tile = U * 16;
  for (int64_t u = 0; u < U; ++u) {
    __m512i wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = _mm512_loadu_si512(w + c * tile + u * 16);
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NC; ++c) acc[r][c] = kvs::fma_unit<T>(acc[r][c], x[r] + u, wv[c]);
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) kvs::store16(y[r] + 16 * c, acc[r][c]);
}

template <typename T>
using DenseFn = void (*)(const uint32_t* const*, const uint32_t*, int64_t, T* const*);

template <typename T, int NC>
constexpr DenseFn<T> kDenseRows[kMR] = {dense_block<T, 1, NC>, dense_block<T, 2, NC>,
                                        dense_block<T, 3, NC>, dense_block<T, 4, NC>,
                                        dense_block<T, 5, NC>, dense_block<T, 6, NC>,
                                        dense_block<T, 7, NC>, dense_block<T, 8, NC>};

template <typename T>
DenseFn<T> dense_fn(int mr, int nc) {
  return nc == 1 ? kDenseRows<T, 1>[mr - 1]
         : nc == 2 ? kDenseRows<T, 2>[mr - 1] : kDenseRows<T, kNC>[mr - 1];
}

template <typename T>
void dense_run(const at::Tensor& x, const at::Tensor& packed, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), N = tiles * 16;
  const int64_t U = K / kvs::kPer<T>, blocks = (tiles + kNC - 1) / kNC;
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  T* yp = static_cast<T*>(y.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int nc = static_cast<int>(std::min<int64_t>(kNC, tiles - b * kNC));
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kMR, M - m0));
        const uint32_t* xr[kMR];
        T* yr[kMR];
        for (int r = 0; r < mr; ++r) {
          xr[r] = xp + (m0 + r) * U;
          yr[r] = yp + (m0 + r) * N + b * kNC * 16;
        }
        dense_fn<T>(mr, nc)(xr, wp + b * kNC * U * 16, U, yr);
      }
    }
  });
}
#elif defined(KVS_AVX2)
// float32 on AVX2: a tile of 16 outputs is two registers; MR rows x one tile of accumulators.
// The weights are float32, or 16-bit (bf16 or float16: dense_pack_half) widened to float32
// exactly as they are loaded, so both read the same sums in the same order and give the same
// results for the same weight values; the 16-bit tiles are half the bytes a decode step reads.
constexpr int kMR = 6;

struct Bf16 {};  // tags of the 16-bit weight formats
struct F16 {};

template <typename W>
inline __m256 weight8(const void* p, int64_t i) {  // weights i .. i + 7 as float32
  if constexpr (std::is_same_v<W, float>) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const auto* h = reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i);
    if constexpr (std::is_same_v<W, F16>) return _mm256_cvtph_ps(_mm_loadu_si128(h));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h)), 16));
  }
}

template <int MR, typename W>
void dense_block(const float* const* x, const void* w, int64_t U, float* const* y) {
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t u = 0; u < U; ++u) {
    const __m256 lo = weight8<W>(w, u * 16), hi = weight8<W>(w, u * 16 + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_set1_ps(x[r][u]);
      acc[r][0] = _mm256_fmadd_ps(a, lo, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, hi, acc[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(y[r], acc[r][0]);
    _mm256_storeu_ps(y[r] + 8, acc[r][1]);
  }
}

using DenseFn = void (*)(const float* const*, const void*, int64_t, float* const*);
template <typename W>
constexpr DenseFn kDenseRows[kMR] = {dense_block<1, W>, dense_block<2, W>, dense_block<3, W>,
                                     dense_block<4, W>, dense_block<5, W>, dense_block<6, W>};

// W: float (float32 tiles [N / 16, K, 16]) or Bf16 / F16 (16-bit tiles of the same shape).
template <typename W>
void dense_run(const at::Tensor& x, const at::Tensor& packed, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), N = tiles * 16;
  const float* xp = x.data_ptr<float>();
  const auto* wp = static_cast<const char*>(packed.data_ptr());
  const int64_t tile = K * 16 * static_cast<int64_t>(packed.element_size());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kMR, M - m0));
        const float* xr[kMR];
        float* yr[kMR];
        for (int r = 0; r < mr; ++r) {
          xr[r] = xp + (m0 + r) * K;
          yr[r] = yp + (m0 + r) * N + t * 16;
        }
        kDenseRows<W>[mr - 1](xr, wp + t * tile, K, yr);
      }
    }
  });
}
#endif

#if defined(KVS_AMX)
// Linux hands a process AMX's tile state only once asked (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); the answer holds for every thread and the whole run.
bool amx_usable() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows x 64 bytes: C (float32 16 x 16) in 0..3, A (16 rows x 32 bf16) in 4..5,
// B (16 input pairs x 16 outputs) in 6..7.
void amx_configure() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// MT tiles of 16 rows (a, row stride lda bytes) x NT tiles of 16 outputs (b, tile stride
// ldb bytes), over `chunks` steps of 32 inputs -> c [MT * 16][NT * 16] float32.
template <int MT, int NT>
void amx_block(const char* a, int64_t lda, const char* b, int64_t ldb, int64_t chunks,
               float* c) {
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (MT > 1) _tile_zero(2);
  if constexpr (MT > 1 && NT > 1) _tile_zero(3);
  for (int64_t k = 0; k < chunks; ++k) {
    _tile_loadd(4, a + k * 64, lda);
    if constexpr (MT > 1) _tile_loadd(5, a + 16 * lda + k * 64, lda);
    _tile_loadd(6, b + k * 1024, 64);
    if constexpr (NT > 1) _tile_loadd(7, b + ldb + k * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT > 1 && NT > 1) _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t ldc = NT * 16 * 4;
  _tile_stored(0, c, ldc);
  if constexpr (NT > 1) _tile_stored(1, c + 16, ldc);
  if constexpr (MT > 1) _tile_stored(2, c + 16 * NT * 16, ldc);
  if constexpr (MT > 1 && NT > 1) _tile_stored(3, c + 16 * NT * 16 + 16, ldc);
}

void amx_run(const at::Tensor& x, const at::Tensor& packed, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), N = tiles * 16;
  const int64_t chunks = K / 32, ldb = K / 2 * 64, lda = K * 2;
  const int64_t blocks = (tiles + 1) / 2, mtiles = (M + 15) / 16;
  const auto* xp = static_cast<const char*>(x.data_ptr());
  const auto* wp = static_cast<const char*>(packed.data_ptr());
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    alignas(64) float c[32 * 32];
    std::vector<char> pad;  // the last rows, padded to whole tiles with zeros
    for (int64_t nb = begin; nb < end; ++nb) {
      const int nt = static_cast<int>(std::min<int64_t>(2, tiles - nb * 2));
      for (int64_t mt = 0; mt < mtiles; mt += 2) {
        const int mtn = static_cast<int>(std::min<int64_t>(2, mtiles - mt));
        const int64_t rows = std::min<int64_t>(mtn * 16, M - mt * 16);
        const char* a = xp + mt * 16 * lda;
        if (rows < mtn * 16) {
          pad.assign(mtn * 16 * lda, 0);
          std::memcpy(pad.data(), a, rows * lda);
          a = pad.data();
        }
        const char* b = wp + nb * 2 * ldb;
        if (mtn == 2 && nt == 2)
          amx_block<2, 2>(a, lda, b, ldb, chunks, c);
        else if (mtn == 2)
          amx_block<2, 1>(a, lda, b, ldb, chunks, c);
        else if (nt == 2)
          amx_block<1, 2>(a, lda, b, ldb, chunks, c);
        else
          amx_block<1, 1>(a, lda, b, ldb, chunks, c);
        for (int64_t r = 0; r < rows; ++r)
          for (int j = 0; j < nt; ++j)
            kvs::store16(yp + (mt * 16 + r) * N + nb * 32 + j * 16,
                         _mm512_loadu_ps(c + r * nt * 16 + j * 16));
      }
    }
    _tile_release();
  });
}
#endif

// Whether a bf16 layer with `k` inputs runs on AMX (fixed for the run: see above).
bool uses_amx(int64_t k) {
#if defined(KVS_AMX)
  return k % 32 == 0 && amx_usable();
#else
  (void)k;
  return false;
#endif
}

// Bytes of one quant_linear tile: 16 outputs x 32 inputs of `bits` each, then 16 float16 d
// and 16 float16 m.
constexpr int64_t tile_bytes(int64_t bits) { return bits * 64 + 2 * 16 * 2; }

// Form kHalves: 8-bit codes, symmetric, with a scale per 16 inputs (GGML's Q6_K keeps one per
// 16): w = (q - 128) d_h, h the half of the group. Its tiles are int8 tiles' size (the 16
// d of inputs 0..15, then the 16 of inputs 16..31, in place of d and m), told apart by their
// dtype: int8 (at::kChar) where the other forms are uint8. AVX2 only.
constexpr int kHalves = 16;
constexpr int64_t form_bytes(int form) { return tile_bytes(form == 4 ? 4 : 8); }

// One call of quant_rows (each instruction set's): NR rows x 16 outputs of one column of tiles,
// from the rows' int8 activations, their group scales dx, dx * sum(xq) and sum(xq).
template <typename T>
using QuantRowsFn = void (*)(const uint8_t*, int64_t, const int8_t* const*, const float* const*,
                             const float* const*, const int32_t* const*, T* const*);
constexpr int64_t kPrefetchGroups = 8;  // weight tiles are fetched this many groups ahead

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
constexpr bool kHasQuantLinear = true;

// quant_linear. Weights in groups of 32 inputs, w = q * d + m with q unsigned (4 bits: 0..15,
// GGML's Q4_1; 8 bits: 0..255, an int8 weight stored as q = w / d + 128 with m = -128 d) and
// d, m float16 per group and output. quant_pack lays them out in tiles of 16 outputs x 32
// inputs: registers whose byte (lane j, byte b) of register c holds input 4c + b of output j
// (4 bits: register c < 4 holds inputs 4c + b in its low nibbles and 4c + 16 + b in its high
// ones), then the 16 d and the 16 m. Activations (float32 or bf16) are quantized per row and
// group to int8 (x ~ xq * dx, as GGML's Q8_1), so that vpdpbusd multiplies 4 pairs per lane
// in integers:
//   y[n] = sum_g d[n,g] * dx[g] * sum_k q[n,k] xq[k]  +  m[n,g] * dx[g] * sum_k xq[k].

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

template <typename T>
void quantize_rows_q8(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx,
                      int32_t* isx) {
  const int64_t G = K / 32;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        const __m512 a = load16(x + m * K + g * 32), b = load16(x + m * K + g * 32 + 16);
        const float amax =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        int8_t* dst = xq + m * K + g * 32;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qb));
        const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        dx[m * G + g] = d;
        sx[m * G + g] = d * static_cast<float>(total);
        isx[m * G + g] = total;
      }
    }
  });
}

// NR rows x 16 outputs over all K / 32 groups of one column of tiles.
template <int Bits, int NR, typename T>
void quant_rows(const uint8_t* tile, int64_t groups, const int8_t* const* xq,
                const float* const* dx, const float* const* sx, const int32_t* const*,
                T* const* y) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, tile += tile_bytes(Bits)) {
    // The weights stream from memory once per call: ask for them a few groups ahead.
    for (int64_t i = 0; i < tile_bytes(Bits); i += 64)
      _mm_prefetch(
          reinterpret_cast<const char*>(tile + kPrefetchGroups * tile_bytes(Bits) + i),
                   _MM_HINT_T0);
    __m512i w[8];
    if constexpr (Bits == 4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i p = _mm512_loadu_si512(tile + 64 * c);
        w[c] = _mm512_and_si512(p, low);
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
      }
    } else {
      for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(tile + 64 * c);
    }
    const auto* scales = reinterpret_cast<const __m256i*>(tile + Bits * 64);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(scales));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(scales + 1));
    for (int r = 0; r < NR; ++r) {
      const auto* xr = reinterpret_cast<const int32_t*>(xq[r] + g * 32);
      __m512i s = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) s = _mm512_dpbusd_epi32(s, w[c], _mm512_set1_epi32(xr[c]));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[r][g])),
                               _mm512_cvtepi32_ps(s), acc[r]);
      acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[r][g]), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) kvs::store16(y[r], acc[r]);
}

constexpr int kQuantRows = 8;
template <int Bits, typename T>
constexpr QuantRowsFn<T> kQuantRowFns[kQuantRows] = {
    quant_rows<Bits, 1, T>, quant_rows<Bits, 2, T>, quant_rows<Bits, 3, T>,
    quant_rows<Bits, 4, T>, quant_rows<Bits, 5, T>, quant_rows<Bits, 6, T>,
    quant_rows<Bits, 7, T>, quant_rows<Bits, 8, T>};

#elif defined(KVS_AVX2)
constexpr bool kHasQuantLinear = true;

// quant_linear on AVX2: the same tiles, activations quantized the same way, and the same
// integer dot products (so the same results), from vpmaddubsw (unsigned x signed bytes ->
// pairs summed in int16) and vpmaddwd (pairs of those -> int32). A register's low half
// holds outputs 0..7 of the tile, its high half outputs 8..15. vpmaddubsw saturates: 4-bit
// weights (0..15) times |x| <= 127 stay below 2^15 even summed over 8 registers; 8-bit
// weights are taken as q - 128 (|s| <= 128, 2 * 128 * 127 < 2^15, with x's sign moved onto
// it), their int16 pairs widened at once, and 128 * sum(x) added back.

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {  // rounded to nearest even, as cvtneps
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r),
                                          _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// x ~ xq * dx per row and group of 32; sx = dx * sum(xq), isx = sum(xq).
template <typename T>
void quantize_rows_q8(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx,
                      int32_t* isx) {
  const int64_t G = K / 32;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        __m256 v[4];
        for (int i = 0; i < 4; ++i) v[i] = load8(x + m * K + g * 32 + 8 * i);
        const __m256 mx = _mm256_max_ps(
            _mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
            _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
        const float amax = kvs::hmax8_ps(mx);
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        __m256i qi[4];
        for (int i = 0; i < 4; ++i)
          qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
        // packs work within 128-bit lanes: dwords come out as (v0 0..3, v1 0..3, v2, v3,
        // v0 4..7, v1 4..7, ...); put each register's 8 bytes back in order.
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                             _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(xq + m * K + g * 32),
            _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                           _mm256_add_epi32(qi[2], qi[3]));
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
        const int32_t total = _mm_cvtsi128_si32(h);
        dx[m * G + g] = d;
        sx[m * G + g] = d * static_cast<float>(total);
        isx[m * G + g] = total;
      }
    }
  });
}

// NR rows x 16 outputs (two passes of 8) over all K / 32 groups of one column of tiles.
template <int Bits, int NR, typename T>
void quant_rows(const uint8_t* column, int64_t groups, const int8_t* const* xq,
                const float* const* dx, const float* const* sx, const int32_t* const* isx,
                T* const* y) {
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int h = 0; h < 2; ++h) {
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* tile = column;
    for (int64_t g = 0; g < groups; ++g, tile += form_bytes(Bits)) {
      if (h == 0)
        for (int64_t i = 0; i < form_bytes(Bits); i += 64)
          _mm_prefetch(
              reinterpret_cast<const char*>(tile + kPrefetchGroups * form_bytes(Bits) + i),
              _MM_HINT_T0);
      const auto* scales = reinterpret_cast<const __m128i*>(tile + (Bits == 4 ? 4 : 8) * 64) + h;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(scales));
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(scales + 2));
      const auto x4 = [&](int r, int c) {  // inputs 4c .. 4c + 3 of row r, in every lane
        return _mm256_set1_epi32(reinterpret_cast<const int32_t*>(xq[r] + g * 32)[c]);
      };
      __m256i s[NR];
      if constexpr (Bits == 4) {
        // The group's 8 weight registers, then each row's products summed in int16.
        __m256i w[8];
        for (int c = 0; c < 4; ++c) {
          const __m256i p =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * c + 32 * h));
          w[c] = _mm256_and_si256(p, low);
          w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
        }
        for (int r = 0; r < NR; ++r) {
          __m256i s16 = _mm256_maddubs_epi16(w[0], x4(r, 0));
          for (int c = 1; c < 8; ++c)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[c], x4(r, c)));
          s[r] = _mm256_madd_epi16(s16, ones);
        }
      } else {
        // 8 bits, q - 128 times x: each weight register loaded once and used for every row,
        // the rows' int32 sums kept in registers. int8 tiles add 128 sum(x) back (their
        // minimum term then takes it away); form kHalves sums inputs 16..31 apart (s2).
        __m256i s2[NR];
        for (int r = 0; r < NR; ++r) {
          s[r] = Bits == kHalves ? _mm256_setzero_si256() : _mm256_set1_epi32(128 * isx[r][g]);
          s2[r] = _mm256_setzero_si256();
        }
        for (int c = 0; c < 8; ++c) {
          const __m256i w = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * c + 32 * h)),
              flip);
          const __m256i a = _mm256_abs_epi8(w);
          for (int r = 0; r < NR; ++r) {
            const __m256i p = _mm256_madd_epi16(
                _mm256_maddubs_epi16(a, _mm256_sign_epi8(x4(r, c), w)), ones);
            if (Bits == kHalves && c >= 4)  // registers 4.. hold inputs 16..31
              s2[r] = _mm256_add_epi32(s2[r], p);
            else
              s[r] = _mm256_add_epi32(s[r], p);
          }
        }
        if constexpr (Bits == kHalves) {  // each half scaled by its own d (mn: the second)
          for (int r = 0; r < NR; ++r) {
            const __m256 dxr = _mm256_set1_ps(dx[r][g]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dxr), _mm256_cvtepi32_ps(s[r]), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(mn, dxr), _mm256_cvtepi32_ps(s2[r]), acc[r]);
          }
          continue;
        }
      }
      for (int r = 0; r < NR; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[r][g])),
                                 _mm256_cvtepi32_ps(s[r]), acc[r]);
        acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sx[r][g]), acc[r]);
      }
    }
    for (int r = 0; r < NR; ++r) store8(y[r] + 8 * h, acc[r]);
  }
}

constexpr int kQuantRows = 4;
template <int Bits, typename T>
constexpr QuantRowsFn<T> kQuantRowFns[kQuantRows] = {
    quant_rows<Bits, 1, T>, quant_rows<Bits, 2, T>, quant_rows<Bits, 3, T>,
    quant_rows<Bits, 4, T>};
constexpr bool kHasQuantHalves = true;
#else
constexpr bool kHasQuantLinear = false;
#endif
#if !defined(KVS_AVX2)
constexpr bool kHasQuantHalves = false;
#endif

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)) || \
    defined(KVS_AVX2)
// x quantized once, then each column of tiles (16 outputs) x blocks of kQuantRows rows.
template <typename T>
void quant_run(const at::Tensor& x, const at::Tensor& packed, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), T_ = packed.size(0), G = K / 32, N = T_ * 16;
  const int64_t tb = packed.size(2);
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * G), sx(M * G);
  std::vector<int32_t> isx(M * G);
  quantize_rows_q8(x.data_ptr<T>(), M, K, xq.data(), dx.data(), sx.data(), isx.data());
  const QuantRowsFn<T>* fns = tb == tile_bytes(4) ? kQuantRowFns<4, T> : kQuantRowFns<8, T>;
#if defined(KVS_AVX2)
  if (packed.scalar_type() == at::kChar) fns = kQuantRowFns<kHalves, T>;
#endif
  const auto* wp = static_cast<const uint8_t*>(packed.data_ptr());
  T* yp = out.data_ptr<T>();
  at::parallel_for(0, T_, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r0 = 0; r0 < M; r0 += kQuantRows) {
        const int64_t nr = std::min<int64_t>(kQuantRows, M - r0);
        const int8_t* xr[kQuantRows];
        const float *dr[kQuantRows], *sr[kQuantRows];
        const int32_t* ir[kQuantRows];
        T* yr[kQuantRows];
        for (int64_t r = 0; r < nr; ++r) {
          xr[r] = xq.data() + (r0 + r) * K;
          dr[r] = dx.data() + (r0 + r) * G;
          sr[r] = sx.data() + (r0 + r) * G;
          ir[r] = isx.data() + (r0 + r) * G;
          yr[r] = yp + (r0 + r) * N + t * 16;
        }
        fns[nr - 1](wp + t * G * tb, G, xr, dr, sr, ir, yr);
      }
    }
  });
}
#endif

}  // namespace

bool has_dense_linear(at::ScalarType dtype) {
  return dtype == at::kFloat ? kvs::kAvx512 || kvs::kAvx2
                             : dtype == at::kBFloat16 && kvs::kAvx512Bf16;
}

at::Tensor dense_pack(const at::Tensor& w) {
  kvs::check_cpu("dense_pack", w);
  TORCH_CHECK(w.dim() == 2 && has_dense_linear(w.scalar_type()),
              "dense_pack: w must be [N, K] float32 or bf16 (with a kernel on this CPU)");
  const int64_t N = w.size(0), K = w.size(1), per = w.scalar_type() == at::kFloat ? 1 : 2;
  TORCH_CHECK(N % 16 == 0 && K % per == 0, "dense_pack needs N % 16 == 0 (and K even for bf16)");
  const int64_t U = K / per;
  // [N, U] units -> [N / 16, U, 16]: a transpose of each tile of 16 outputs.
  return w.contiguous().view({N / 16, 16, U * per}).view(at::kInt).transpose(1, 2)
      .contiguous().view(w.scalar_type()).view({N / 16, U, 16 * per});
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed) {
  kvs::check_cpu("dense_linear", x, packed);
#if defined(KVS_AVX2)
  if (x.scalar_type() == at::kFloat && packed.element_size() == 2) {  // dense_pack_half's
    TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(1) == x.size(1) &&
                    packed.size(2) == 16, "packed weight shape does not match x");
    auto y = at::empty({x.size(0), packed.size(0) * 16}, x.options());
    if (packed.scalar_type() == at::kHalf)
      dense_run<F16>(x.contiguous(), packed.contiguous(), y);
    else
      dense_run<Bf16>(x.contiguous(), packed.contiguous(), y);
    return y;
  }
#endif
  TORCH_CHECK(has_dense_linear(x.scalar_type()), "dense_linear: no kernel for this dtype");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.scalar_type() == x.scalar_type(),
              "x [M, K] and dense_pack's tiles of x's dtype");
  const int64_t per = x.scalar_type() == at::kFloat ? 1 : 2;
  TORCH_CHECK(packed.size(1) * per == x.size(1) && packed.size(2) == 16 * per,
              "packed weight shape does not match x");
  auto xc = x.contiguous();
  auto y = at::empty({x.size(0), packed.size(0) * 16}, x.options());
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) {
    dense_run<float>(xc, packed.contiguous(), y);
  } else {
#if defined(KVS_AMX)
    if (uses_amx(x.size(1))) {
      amx_run(xc, packed.contiguous(), y);
      return y;
    }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    dense_run<c10::BFloat16>(xc, packed.contiguous(), y);
#endif
  }
#elif defined(KVS_AVX2)
  dense_run<float>(xc, packed.contiguous(), y);
#endif
  return y;
}

bool has_dense_half() { return kvs::kAvx2; }

at::Tensor dense_pack_half(const at::Tensor& w) {
  kvs::check_cpu("dense_pack_half", w);
  TORCH_CHECK(has_dense_half(), "dense_pack_half: no 16-bit weight kernel on this CPU");
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
              "dense_pack_half: w must be [N, K] bf16 or float16");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0, "dense_pack_half needs N % 16 == 0");
  return w.contiguous().view({N / 16, 16, K}).transpose(1, 2).contiguous();
}

bool dense_uses_amx(int64_t k) { return uses_amx(k); }

bool has_quant_linear() { return kHasQuantLinear; }

bool has_quant_halves() { return kHasQuantHalves; }

// quant_pack: q [N, K] uint8 (0..15 for bits 4, 0..255 for bits 8), d and m [N, K / 32] ->
// quant_linear's tiles, [N / 16, K / 32, tile bytes] uint8 (N a multiple of 16, K of 32).
// 8 bits with d and m [N, K / 16] and m = -128 d: form kHalves's tiles, int8.
at::Tensor quant_pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                      int64_t bits) {
  kvs::check_cpu("quant_pack", q, d, m);
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "q must be [N, K] uint8");
  const int64_t N = q.size(0), K = q.size(1), G = K / 32;
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "quant_pack needs N % 16 == 0 and K % 32 == 0");
  auto qc = q.contiguous();
  auto dh = d.to(at::kHalf).contiguous(), mh = m.to(at::kHalf).contiguous();
  // A scale per 16 inputs: form kHalves, which holds symmetric codes only (m = -128 d).
  const bool halves = dh.dim() == 2 && dh.size(1) == 2 * G;
  TORCH_CHECK(!halves || (bits == 8 && kHasQuantHalves),
              "scales per 16 inputs need 8-bit codes and the AVX2 kernel");
  TORCH_CHECK(!halves || at::equal(mh, (dh.to(at::kFloat) * -128).to(at::kHalf)),
              "scales per 16 inputs hold symmetric codes only: m must be -128 d");
  TORCH_CHECK(dh.dim() == 2 && dh.size(0) == N && (dh.size(1) == G || halves) &&
                  mh.sizes() == dh.sizes(),
              "d and m must be [N, K / 32] (or [N, K / 16] for 8 bits)");
  const int64_t tb = tile_bytes(bits);
  auto out = at::zeros({N / 16, G, tb}, q.options());
  const uint8_t* qp = qc.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(dh.data_ptr());
  const auto* mp = reinterpret_cast<const uint16_t*>(mh.data_ptr());
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t t = 0; t < N / 16; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* tile = op + (t * G + g) * tb;
      for (int64_t j = 0; j < 16; ++j) {
        const uint8_t* row = qp + (t * 16 + j) * K + g * 32;
        for (int64_t k = 0; k < 32; ++k) {
          if (bits == 8) {
            tile[64 * (k / 4) + 4 * j + k % 4] = row[k];
          } else {  // inputs 16.. go to the high nibbles of the registers of inputs 0..15
            const int64_t lo = k % 16;
            tile[64 * (lo / 4) + 4 * j + lo % 4] |=
                static_cast<uint8_t>((row[k] & 15) << (k < 16 ? 0 : 4));
          }
        }
        if (halves) {
          std::memcpy(tile + bits * 64 + 2 * j, dp + (t * 16 + j) * 2 * G + 2 * g, 2);
          std::memcpy(tile + bits * 64 + 32 + 2 * j, dp + (t * 16 + j) * 2 * G + 2 * g + 1, 2);
        } else {
          std::memcpy(tile + bits * 64 + 2 * j, dp + (t * 16 + j) * G + g, 2);
          std::memcpy(tile + bits * 64 + 32 + 2 * j, mp + (t * 16 + j) * G + g, 2);
        }
      }
    }
  }
  return halves ? out.view(at::kChar) : out;
}

// quant_linear: x [M, K] float32 or bf16 times quant_pack's tiles [N / 16, K / 32, tile
// bytes] (the tile size tells 4 from 8 bits) -> [M, N] in x's dtype.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed) {
  kvs::check_cpu("quant_linear", x, packed);
  TORCH_CHECK(kHasQuantLinear, "quant_linear needs AVX512-VNNI and AVX512-BF16, or AVX2");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 ||
                               x.scalar_type() == at::kFloat), "x must be [M, K] bf16/float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) * 32 == x.size(1), "packed weight shape");
  const int64_t tb = packed.size(2);
  TORCH_CHECK((tb == tile_bytes(4) || tb == tile_bytes(8)) &&
                  (packed.scalar_type() == at::kByte ||
                   (packed.scalar_type() == at::kChar && tb == tile_bytes(8) && kHasQuantHalves)),
              "not quant_pack's tiles");
  auto out = at::empty({x.size(0), packed.size(0) * 16}, x.options());
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)) || \
    defined(KVS_AVX2)
  auto xc = x.contiguous();
  if (x.scalar_type() == at::kFloat)
    quant_run<float>(xc, packed, out);
  else
    quant_run<c10::BFloat16>(xc, packed, out);
#endif
  return out;
}
