// Shared by the CPU kernels: what each file provides, and the small vector helpers they use.
//
// Batch invariance is the rule every kernel here keeps: an output row is computed by the same
// instructions in the same order whatever the other rows of the call are, how many there
// are, or which thread runs it. Work is split only across rows (or across outputs that are
// summed separately); never along a reduction.
#pragma once

// ATen, not torch/extension.h: the kernels need tensors only, and torch's whole API with
// pybind11 took ~20 s more to compile per file, once per x86 level built (build_spec.py).
// layers.cpp, which defines the Python module, includes it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3, Intel before Skylake-X and the client
// cores): float32 attention and matmuls, and the int4/int8 matmul on vpmaddubsw, with 8-lane
// registers. The same contract holds (batch invariance); the results are the AVX-512
// kernels' for the matmuls (same sums in the same order), not for attention (other reduction
// trees), so an engine's tokens are a function of the CPU's instruction set too.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVS_AVX2 1
#endif

#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// attention.cpp
bool has_paged_attention(at::ScalarType dtype, at::ScalarType kv);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& seqs,
                           const at::Tensor& tables, int64_t block_size, double scale,
                           int64_t window, const c10::optional<at::Tensor>& sinks);

// linear.cpp
bool has_dense_linear(at::ScalarType dtype);
at::Tensor dense_pack(const at::Tensor& w);
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed);
bool dense_uses_amx(int64_t k);
bool has_dense_half();
at::Tensor dense_pack_half(const at::Tensor& w);
bool has_quant_linear();
bool has_quant_halves();
at::Tensor quant_pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                      int64_t bits);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed);

// gguf_linear.cpp
// One matrix in a GGUF file's blocks, as gguf_linear takes it: its parts (outputs side by
// side), their GGML (or interleaved) types, and each part's row order (empty: as stored).
struct GGUFMatrix {
  std::vector<at::Tensor> parts;
  std::vector<int64_t> types;
  std::vector<at::Tensor> rows;
};
bool gguf_supports(int64_t type);
std::string gguf_path();
std::vector<std::string> gguf_paths();
at::Tensor gguf_linear(const at::Tensor& x, const std::vector<at::Tensor>& parts,
                       const std::vector<int64_t>& types, const std::vector<at::Tensor>& rows,
                       const std::string& path);
at::Tensor gguf_grouped(const at::Tensor& x, const std::vector<int64_t>& offsets,
                        const std::vector<const GGUFMatrix*>& mats, const std::string& path);
// moe.cpp
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t k,
                                             bool normalize, bool topk_softmax);
at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& pos, const at::Tensor& weights);

at::Tensor gguf_rows(const at::Tensor& part, int64_t type, int64_t K, const at::Tensor& ids,
                     at::ScalarType dtype);
int64_t gguf_repacked_type(int64_t type);
at::Tensor gguf_repack(const at::Tensor& part, int64_t type, int64_t K, const at::Tensor& order,
                       at::Tensor out);

namespace kvs {

// Every entry point reads its tensors' memory on the host: a tensor that lives elsewhere (a
// GPU, the meta device) is refused by name here, never dereferenced.
inline void check_cpu(const char* fn, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), fn, ": CPU tensors only, got one on ", t.device());
}
template <typename... Ts>
inline void check_cpu(const char* fn, const at::Tensor& t, const Ts&... rest) {
  check_cpu(fn, t);
  check_cpu(fn, rest...);
}
inline void check_cpu(const char* fn, const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) check_cpu(fn, t);
}

// What this build's instruction set allows (its variant's -march: build_spec.py).
#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kAvx512Bf16 = true;
#else
constexpr bool kAvx512Bf16 = false;
#endif
#if defined(KVS_AVX2)
constexpr bool kAvx2 = true;
#else
constexpr bool kAvx2 = false;
#endif

// n float32 values -> float16 (N = c10::Half) or bf16 (c10::BFloat16), rounded to nearest
// even as torch's .to() rounds: F16C's vcvtps2ph in round-to-nearest mode; for bf16, the
// upper half after adding 0x7fff plus the lowest kept bit, a NaN becoming 0x7fc0
// (c10::BFloat16's own rule). The vector and scalar forms give the same bits.
template <typename N>
void narrow_row(const float* src, N* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    __m128i h;
    if constexpr (std::is_same_v<N, c10::Half>) {
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
      const __m256i b = _mm256_castps_si256(x);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_srli_epi32(
          _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
      // 8 x 32-bit (each < 2^16) -> 8 x 16-bit: pack within 128-bit lanes, then gather them.
      r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
      h = _mm256_castsi256_si128(r);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<N>(src[i]);
}

#if defined(__AVX2__) && defined(__F16C__)
// 8 values as float32, exactly: float32 as is, float16 by F16C, bf16 (a float's top half)
// shifted into place.
template <typename T>
inline __m256 widen8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<T, c10::Half>)
      return _mm256_cvtph_ps(h);
    else
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}
#endif

// Values per 32-bit "unit", the operands of one multiply-add lane: a float32 value (fmadd),
// or a pair of bf16 values (dpbf16, which adds both products to the lane).
template <typename T>
constexpr int64_t kPer = std::is_same_v<T, float> ? 1 : 2;

// exp(x) = 2^(x log2 e) as 2^k times a degree-6 polynomial for 2^f, f in [-0.5, 0.5], within
// ~2 ulp: its coefficients from the highest power down, Horner's order (exp_ps, exp8_ps).
constexpr float kLog2e = 1.44269504f;
constexpr float kExp2Poly[7] = {0.000154035304f, 0.00133335581f, 0.00961812911f,
                                0.0555041087f,   0.240226507f,   0.693147182f, 1.f};

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

#if defined(__AVX512F__)
// exp(x) on 16 lanes for the softmax, without a call per element (kExp2Poly). x is clamped
// at -87 so 2^k stays a normal float; the inputs are scores minus their maximum, and
// exp(-87) is negligible beside the maximum's 1.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, k);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// acc += a * b: a one unit broadcast to every lane, b a unit per lane.
template <typename T>
inline __m512 fma_unit(__m512 acc, const uint32_t* a, __m512i b) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_fmadd_ps(_mm512_set1_ps(*reinterpret_cast<const float*>(a)),
                           _mm512_castsi512_ps(b), acc);
  } else {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(*a)),
                            (__m512bh)b);
#else
    static_assert(!std::is_same_v<T, T>, "bf16 needs AVX512-BF16");
#endif
  }
}

// 16 float32 results stored as T (bf16: rounded to nearest even).
template <typename T>
inline void store16(T* dst, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(dst, v);
  } else {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
#else
    static_assert(!std::is_same_v<T, T>, "bf16 needs AVX512-BF16");
#endif
  }
}

// 16 x 16 32-bit transpose in registers: r[i] lane j -> r[j] lane i.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // r[4a + b] now holds, in its 128-bit lane L, column 4L + b of rows 4a .. 4a + 3; gather
  // the lanes of the four row groups.
  for (int b = 0; b < 4; ++b) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x88);
    const __m512i x1 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xDD);
    const __m512i x2 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x88);
    const __m512i x3 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xDD);
    t[b] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    t[4 + b] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    t[8 + b] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    t[12 + b] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

#if defined(KVS_AVX2)
// exp_ps on 8 lanes: the same clamp, reduction and polynomial.
inline __m256 exp8_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2e));
  const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, k);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// Sum and maximum of 8 lanes, in one fixed tree.
inline float hsum8_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8_ps(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// 8 x 8 float32 transpose in registers: r[i] lane j -> r[j] lane i.
inline void transpose8(__m256* r) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}
#endif

}  // namespace kvs
