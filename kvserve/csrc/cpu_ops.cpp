// CPU kernels: for the decode path, where a step is many small ops and each op's fixed cost
// adds up, one call here replaces several torch ops; and two kernels torch lacks on this CPU,
// the attention of prompt chunks and an integer matmul for quantized weights.
//
// decode_attention: one query token per sequence attends to its context, read block by block
// through its block table (no gather into a new tensor).
// q [B, H, D], cache [2, Hkv, slots, D] (K then V; float32 or bfloat16, contiguous),
// tables [B, W] int64 block ids, lens [B] int64 context lengths (the new token included).
// Query heads h * G .. h * G + G - 1 share KV head h (grouped-query attention).
//
// rms_norm: x [N, C] -> x * rsqrt(mean(x^2) + eps) rounded to x's dtype, times the weight, as
// the reference computes it (float32 statistics).
//
// prefill_attention: a prompt chunk attends causally to its request's paged context with
// AVX512-BF16 dot products: ~4-7x faster than torch's SDPA here, which runs at about the
// float32 matmul rate (140-170 GFLOP/s) on bf16 inputs.
//
// quant_pack / quant_linear: x W^T for int4 (GGML's Q4_1) or int8 weights in groups of 32,
// with x quantized to int8 per group (GGML's Q8_1) and AVX512-VNNI integer dot products;
// faster than torch's int4/int8 kernels and than the bf16 matmul at every batch size here.
//
// store_kv: K/V rows into their cache slots (what index_copy_ does, without the stacked copy).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed);

namespace {

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kLanes = 16;  // partial sums per dot product, so the compiler vectorizes

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) {
  uint16_t bits;
  std::memcpy(&bits, p + i, sizeof bits);
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load(src, i);
}

inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  // One register of partial sums and one tree reduction: the portable version below left a
  // chain of scalar adds that took about a quarter of the decode-attention time (perf).
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return _mm512_reduce_add_ps(acc);
#else
  float part[kLanes] = {0.f};
  for (int64_t i = 0; i < n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) part[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) s += part[j];
  return s;
#endif
}

// q.k straight from the stored rows, without converting them first. With AVX512-BF16 the
// products of two bf16 values are exact in float32 (n a multiple of 32); `run` uses this only
// where that instruction exists, the plain loop is its definition elsewhere.
template <typename T>
inline float dot_direct(const T* a, const T* b, int64_t n) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + i),
                             (__m512bh)_mm512_loadu_si512(b + i));
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += load(a, i) * load(b, i);
  return s;
}

#if defined(__AVX512BF16__)
// q.k for 16 consecutive bf16 rows k (stride D) at once, into out[0..16): 16 accumulators,
// then one transposing reduction tree (45 shuffles and adds instead of 16 horizontal sums
// of 8 each, which dominated the decode kernel). D a multiple of 32.
inline void dots16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t D, float* out) {
  __m512 v[16];
  for (int j = 0; j < 16; ++j) v[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + i);
    for (int j = 0; j < 16; ++j)
      v[j] = _mm512_dpbf16_ps(v[j], qv, (__m512bh)_mm512_loadu_si512(k + j * D + i));
  }
  // Pairs, then quads within each 128-bit lane: b[r] holds, per lane, partial sums of rows
  // 4r .. 4r+3; then the four lanes are added across, rows landing in order.
  __m512 a[8], b[4];
  for (int r = 0; r < 8; ++r)
    a[r] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * r], v[2 * r + 1]),
                         _mm512_unpackhi_ps(v[2 * r], v[2 * r + 1]));
  for (int r = 0; r < 4; ++r) {
    const __m512d x = _mm512_castps_pd(a[2 * r]), y = _mm512_castps_pd(a[2 * r + 1]);
    b[r] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                  _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                  _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88),
                                      _mm512_shuffle_f32x4(d0, d1, 0xDD)));
}
#endif

// exp(x) for the softmax without a call per element (std::exp): the scalar form, for tails
// and CPUs without AVX-512; exp_ps below is the same on 16 lanes. 2^(x log2 e) as 2^k times
// a degree-6 polynomial for 2^f, f in [-0.5, 0.5], within ~2 ulp. x is clamped at -87 so
// 2^k stays a normal float; the inputs are scores minus their maximum, and exp(-87) is
// negligible beside the maximum's 1.
inline float softmax_exp(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.44269504f;
  const float k = std::floor(t + 0.5f);
  const float f = t - k;
  const float p = 1.f + f * (0.693147182f + f * (0.240226507f + f * (0.0555041087f +
                  f * (0.00961812911f + f * (0.00133335581f + f * 0.000154035304f)))));
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX512F__)
// softmax_exp on 16 lanes.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, k);
  __m512 p = _mm512_set1_ps(0.000154035304f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.00133335581f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.00961812911f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555041087f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240226507f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693147182f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// p_j * row_j summed over n rows of NV * 16 floats into acc, the sums held in registers.
template <int NV>
inline void pv_rows(const float* p, const float* rows, int64_t n, float* acc) {
  __m512 a[NV];
  for (int c = 0; c < NV; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    for (int c = 0; c < NV; ++c)
      a[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(rows + j * NV * 16 + 16 * c), a[c]);
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}
#endif

template <typename T>
void run(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
         const at::Tensor& lens, int64_t block_size, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = cache.size(1), slots = cache.size(2), W = tables.size(1);
  const int64_t G = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = cache.data_ptr<T>();
  const T* vp = kp + Hkv * slots * D;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  // One work item per (KV head, sequence), its G query heads together: each K row and each
  // converted V block is used by all G heads while it is in L1, instead of G passes over
  // the context. Items run KV head by KV head, with sequences ordered by their first block,
  // so sequences that share a prefix (prefix caching) follow one another and find the
  // shared blocks still in L2. With few sequences the items would be too few to spread
  // evenly over the threads (batch 1: one per KV head), so there each query head is an item.
#if defined(__AVX512BF16__)
  // bf16 K rows are read as they are stored; the scale is applied after the dot, not to q.
  const bool direct = std::is_same_v<T, c10::BFloat16> && D % 32 == 0;
#else
  const bool direct = false;
#endif
  const float scale_f = static_cast<float>(scale);
  std::vector<int64_t> order(B);
  for (int64_t b = 0; b < B; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return (lp[x] > 0 ? tp[x * W] : -1) < (lp[y] > 0 ? tp[y * W] : -1);
  });
  const int64_t per = B * Hkv >= 4 * at::get_num_threads() ? G : 1;  // heads per item
  const int64_t items = B * Hkv * (G / per);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(per * D), acc(per * D), scores, rows(block_size * D), top(per), sum(per);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t sub = i % (G / per), rest = i / (G / per);
      const int64_t g = rest / B, b = order[rest % B], h0 = g * G + sub * per;
      const int64_t len = lp[b];
      const int64_t* table = tp + b * W;
      const T* qrow = qp + (b * H + h0) * D;  // the item's heads are contiguous rows
      if (!direct) {
        to_float(qrow, qf.data(), per * D);
        for (auto& x : qf) x *= scale_f;
      }
      scores.resize(per * len);
      std::fill(top.begin(), top.end(), -INFINITY);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t n = std::min(block_size, len - t0);
        const T* kb = kp + (g * slots + table[t0 / block_size] * block_size) * D;
        if (!direct) to_float(kb, rows.data(), n * D);
        int64_t j = 0;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          for (; direct && j + 16 <= n; j += 16) {
            for (int64_t h = 0; h < per; ++h) {
              float* sc = scores.data() + h * len + t0 + j;
              dots16(qrow + h * D, kb + j * D, D, sc);
              const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sc), _mm512_set1_ps(scale_f));
              _mm512_storeu_ps(sc, v);
              top[h] = std::max(top[h], _mm512_reduce_max_ps(v));
            }
          }
        }
#endif
        for (; j < n; ++j) {
          for (int64_t h = 0; h < per; ++h) {
            const float s = direct ? dot_direct(qrow + h * D, kb + j * D, D) * scale_f
                                   : dot(qf.data() + h * D, rows.data() + j * D, D);
            scores[h * len + t0 + j] = s;
            top[h] = std::max(top[h], s);
          }
        }
      }
      for (int64_t h = 0; h < per; ++h) {
        float* sc = scores.data() + h * len;
        int64_t t = 0;
        float total = 0.f;
#if defined(__AVX512F__)
        // The compiler left softmax_exp scalar here (a quarter of the kernel's time, perf).
        const __m512 shift = _mm512_set1_ps(top[h]);
        __m512 part = _mm512_setzero_ps();
        for (; t + 16 <= len; t += 16) {
          const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + t), shift));
          _mm512_storeu_ps(sc + t, e);
          part = _mm512_add_ps(part, e);
        }
        total = _mm512_reduce_add_ps(part);
#endif
        for (; t < len; ++t) {
          sc[t] = softmax_exp(sc[t] - top[h]);
          total += sc[t];
        }
        sum[h] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t n = std::min(block_size, len - t0);
        to_float(vp + (g * slots + table[t0 / block_size] * block_size) * D, rows.data(), n * D);
        // kLanes output columns at a time, their sums held in registers over the block's
        // rows (accumulating into `acc` itself stored it back after every row).
        for (int64_t h = 0; h < per; ++h) {
          const float* sc = scores.data() + h * len + t0;
          float* ah = acc.data() + h * D;
#if defined(__AVX512F__)
          if (D == 64) {
            pv_rows<4>(sc, rows.data(), n, ah);
            continue;
          }
          if (D == 128) {
            pv_rows<8>(sc, rows.data(), n, ah);
            continue;
          }
#endif
          for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
            float a[kLanes];
            for (int64_t c = 0; c < kLanes; ++c) a[c] = ah[d0 + c];
            for (int64_t j = 0; j < n; ++j) {
              const float p = sc[j];
              const float* r = rows.data() + j * D + d0;
              for (int64_t c = 0; c < kLanes; ++c) a[c] += p * r[c];
            }
            for (int64_t c = 0; c < kLanes; ++c) ah[d0 + c] = a[c];
          }
        }
      }
      for (int64_t h = 0; h < per; ++h) {
        const float inv = 1.f / sum[h];
        T* o = op + (b * H + h0 + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[h * D + d] * inv);
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& cache,
                            const at::Tensor& tables, const at::Tensor& lens,
                            int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 4 && cache.size(0) == 2, "bad shapes");
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(cache.size(3) == q.size(2), "cache rows must be head_dim wide");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= kMaxHeadDim, "unsupported head_dim");
  TORCH_CHECK(q.size(1) % cache.size(1) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "tables and lens must be int64");
  auto tab = tables.contiguous();
  auto len = lens.contiguous();
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, cache, tab, len, block_size, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(q, cache, tab, len, block_size, scale, out);
  } else {
    TORCH_CHECK(false, "decode_attention supports float32 and bfloat16");
  }
  return out;
}

template <typename T>
void rms_rows(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t N = x.size(0), C = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Rows are cheap (C ~ 1k): split only when there are many of them.
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(C);
    for (int64_t i = begin; i < end; ++i) {
      to_float(xp + i * C, row.data(), C);
      float part[kLanes] = {0.f};
      const int64_t body = C - C % kLanes;
      for (int64_t c = 0; c < body; c += kLanes)
        for (int64_t j = 0; j < kLanes; ++j) part[j] += row[c + j] * row[c + j];
      float ss = 0.f;
      for (int64_t j = 0; j < kLanes; ++j) ss += part[j];
      for (int64_t c = body; c < C; ++c) ss += row[c] * row[c];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(C) + static_cast<float>(eps));
      T* o = op + i * C;
      for (int64_t c = 0; c < C; ++c) {
        const T normed = static_cast<T>(row[c] * r);  // rounded first, as the reference does
        o[c] = static_cast<T>(static_cast<float>(normed) * load(wp, c));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(), "bad input");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight shape");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    rms_rows<float>(x, weight, eps, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_rows<c10::BFloat16>(x, weight, eps, out);
  } else {
    TORCH_CHECK(false, "rms_norm supports float32 and bfloat16");
  }
  return out;
}

// y = x W^T (+ b) as kvserve.layers.linear computes it: the weight-only quantized copy (int4
// packed as uint8 in groups of `group`, or int8) for batches up to `small_batch` rows, the
// compute-dtype weight otherwise; quant_linear's packed tiles for every batch. Missing pieces
// are empty tensors.
at::Tensor linear(const at::Tensor& x, const at::Tensor* p, int64_t small_batch, int64_t group) {
  const at::Tensor &w = p[0], &q = p[1], &s = p[2], &b = p[3];
  at::Tensor y;
  if (q.dim() == 3) {  // quant_pack's tiles: quant_linear serves every batch
    y = quant_linear(x, q);
  } else if (q.numel() && x.size(0) <= small_batch) {
    y = q.scalar_type() == at::kByte ? at::_weight_int4pack_mm_for_cpu(x, q, group, s)
                                     : at::_weight_int8pack_mm(x, q, s);
  } else {
    y = at::linear(x, w);
  }
  return b.numel() ? y + b : y;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kHasPrefillAttention = true;

// prefill_attention, the inner products: NR query rows against one tile of 16 keys. K is
// packed so that a register holds one pair of dimensions (two bf16 in a 32-bit lane) of the
// 16 keys: broadcasting a query's matching pair and one dpbf16 per pair of dimensions leaves
// the 16 scores in one register, with no horizontal sums.
template <int NR>
inline void qk_tile(const uint32_t* const* qrows, const uint32_t* ktile, int64_t pairs,
                    float* const* out) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(ktile + i * 16);
    for (int r = 0; r < NR; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(qrows[r][i]), k);
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out[r], acc[r]);
}

// NR rows of probabilities (bf16, consecutive keys paired in 32-bit lanes) times V, packed so
// that a register holds 16 dimensions of two consecutive keys: out[r][d0..d0+16).
template <int NR>
inline void pv_cols(const uint32_t* const* prows, const uint32_t* vcols, int64_t key_pairs,
                    int64_t D, __m512* acc) {
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < key_pairs; ++j) {
    const __m512bh v = (__m512bh)_mm512_loadu_si512(vcols + j * D);
    for (int r = 0; r < NR; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(prows[r][j]), v);
  }
}

constexpr int kRowBlock = 12;

template <int NR>
void row_block(const uint32_t* const* qrows, float* const* sc, const int64_t* nkeys,
               uint16_t* const* pbf, const uint32_t* kpk, const uint32_t* vpk, int64_t D,
               float scale, c10::BFloat16* const* orows) {
  const int64_t pairs = D / 2;
  int64_t most = 0;
  for (int r = 0; r < NR; ++r) most = std::max(most, nkeys[r]);
  const int64_t tiles = (most + 15) / 16;
  for (int64_t kt = 0; kt < tiles; ++kt) {
    float* out[NR];
    for (int r = 0; r < NR; ++r) out[r] = sc[r] + kt * 16;
    qk_tile<NR>(qrows, kpk + kt * pairs * 16, pairs, out);
  }
  float inv[NR];
  const uint32_t* prows[NR];
  for (int r = 0; r < NR; ++r) {
    // Softmax over the row's n keys, 16 at a time; the last tile's keys past n get 0.
    const float* s = sc[r];
    const int64_t n = nkeys[r], full = n / 16;
    const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < full; ++t) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t * 16));
    top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, s + full * 16));
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top) * scale);
    const __m512 sc16 = _mm512_set1_ps(scale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < tiles; ++t) {
      const __mmask16 live = t < full ? 0xffff : t == full ? tail : 0;
      const __m512 e = _mm512_maskz_mov_ps(
          live, exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s + t * 16), sc16, shift)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pbf[r] + t * 16),
                          (__m256i)_mm512_cvtneps_pbh(e));
    }
    inv[r] = 1.f / _mm512_reduce_add_ps(sum);
    prows[r] = reinterpret_cast<const uint32_t*>(pbf[r]);
  }
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512 acc[NR];
    pv_cols<NR>(prows, vpk + d0, tiles * 8, D, acc);
    for (int r = 0; r < NR; ++r)
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(orows[r] + d0),
          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r], _mm512_set1_ps(inv[r]))));
  }
}

using RowBlockFn = void (*)(const uint32_t* const*, float* const*, const int64_t*,
                            uint16_t* const*, const uint32_t*, const uint32_t*, int64_t, float,
                            c10::BFloat16* const*);
constexpr RowBlockFn kRowBlocks[kRowBlock] = {
    row_block<1>, row_block<2>, row_block<3>, row_block<4>,  row_block<5>,  row_block<6>,
    row_block<7>, row_block<8>, row_block<9>, row_block<10>, row_block<11>, row_block<12>};

// q [Q, H, D] bf16: the chunk's queries, at positions ctx_len - Q .. ctx_len - 1 of a request
// whose K/V for positions 0 .. ctx_len - 1 (the chunk's own included) are in `cache` at the
// slots of `table` (its block ids). Causal: query i sees keys 0 .. ctx_len - Q + i.
// Each KV head's keys and values are first packed for dpbf16 (K by pairs of dimensions, V by
// pairs of keys, zero past the end); then every (query tile, KV head) item computes all its
// scores, an exact softmax in float32 over them, and P.V with P rounded to bf16.
void prefill_attention_impl(const at::Tensor& q, const at::Tensor& cache,
                            const at::Tensor& table, int64_t ctx_len, int64_t block_size,
                            double scale, at::Tensor& out) {
  const int64_t Q = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = cache.size(1), slots = cache.size(2), G = H / Hkv;
  const int64_t L = ctx_len, first = L - Q, tiles = (L + 15) / 16, pairs = D / 2;
  const auto* kp = reinterpret_cast<const uint16_t*>(cache.data_ptr());
  const uint16_t* vp = kp + Hkv * slots * D;
  const int64_t* tb = table.data_ptr<int64_t>();
  // kpk: [Hkv][tiles][pairs][16] pairs of K dimensions; vpk: [Hkv][tiles * 8][D] pairs of
  // V rows (key 2j in the low half, 2j + 1 in the high half of each lane).
  std::vector<uint32_t> kpk(Hkv * tiles * pairs * 16), vpk(Hkv * tiles * 8 * D);
  auto row_of = [&](const uint16_t* base, int64_t g, int64_t t) -> const uint16_t* {
    return base + (g * slots + tb[t / block_size] * block_size + t % block_size) * D;
  };
  at::parallel_for(0, Hkv * tiles, 8, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> zero(D, 0);
    __m512i lo_idx, hi_idx;  // interleave 16 values of row a with 16 of row b
    {
      alignas(64) uint16_t lo[32], hi[32];
      for (int i = 0; i < 16; ++i) {
        lo[2 * i] = i; lo[2 * i + 1] = 32 + i;
        hi[2 * i] = 16 + i; hi[2 * i + 1] = 48 + i;
      }
      lo_idx = _mm512_load_si512(lo);
      hi_idx = _mm512_load_si512(hi);
    }
    for (int64_t it = begin; it < end; ++it) {
      const int64_t g = it / tiles, kt = it % tiles;
      uint32_t* kdst = kpk.data() + it * pairs * 16;
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t t = kt * 16 + j;
        const auto* k = reinterpret_cast<const uint32_t*>(t < L ? row_of(kp, g, t)
                                                                 : zero.data());
        for (int64_t i = 0; i < pairs; ++i) kdst[i * 16 + j] = k[i];
      }
      for (int64_t j = 0; j < 8; ++j) {
        const int64_t t = kt * 16 + 2 * j;
        const uint16_t* a = t < L ? row_of(vp, g, t) : zero.data();
        const uint16_t* b = t + 1 < L ? row_of(vp, g, t + 1) : zero.data();
        uint32_t* vdst = vpk.data() + (it * 8 + j) * D;
        for (int64_t d = 0; d < D; d += 32) {
          const __m512i va = _mm512_loadu_si512(a + d), vb = _mm512_loadu_si512(b + d);
          _mm512_storeu_si512(vdst + d, _mm512_permutex2var_epi16(va, lo_idx, vb));
          _mm512_storeu_si512(vdst + d + 16, _mm512_permutex2var_epi16(va, hi_idx, vb));
        }
      }
    }
  });
  // Work items: (query tile, KV head), the costliest (latest) tiles first, handed out one at
  // a time so that the causal triangle's uneven items balance over the threads.
  constexpr int64_t kTileQ = 4;
  const int64_t qtiles = (Q + kTileQ - 1) / kTileQ, items = qtiles * Hkv;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* op = out.data_ptr<c10::BFloat16>();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int64_t R = kTileQ * G;
    std::vector<float> scores(R * tiles * 16);
    std::vector<uint16_t> probs(R * tiles * 16);
    for (int64_t it; (it = next.fetch_add(1)) < items;) {
      const int64_t tile = qtiles - 1 - it / Hkv, g = it % Hkv;
      const int64_t i0 = tile * kTileQ, nq = std::min(kTileQ, Q - i0), rows = nq * G;
      // Near-equal row blocks of at most kRowBlock rows (each dpbf16 has a row of its own).
      const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
      for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
        const int64_t nr = (rows - r0) / (blocks - b);
        const uint32_t* qrows[kRowBlock];
        float* sc[kRowBlock];
        uint16_t* pb[kRowBlock];
        int64_t nkeys[kRowBlock];
        c10::BFloat16* orows[kRowBlock];
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t i = i0 + (r0 + r) / G, h = g * G + (r0 + r) % G;
          qrows[r] = reinterpret_cast<const uint32_t*>(qp + (i * H + h) * D);
          sc[r] = scores.data() + (r0 + r) * tiles * 16;
          pb[r] = probs.data() + (r0 + r) * tiles * 16;
          nkeys[r] = first + i + 1;
          orows[r] = op + (i * H + h) * D;
        }
        kRowBlocks[nr - 1](qrows, sc, nkeys, pb, kpk.data() + g * tiles * pairs * 16,
                           vpk.data() + g * tiles * 8 * D, D, static_cast<float>(scale),
                           orows);
        r0 += nr;
      }
    }
  });
}
#else
constexpr bool kHasPrefillAttention = false;
#endif

// Bytes of one quant_linear tile: 16 outputs x 32 inputs of `bits` each, then 16 float16 d
// and 16 float16 m.
constexpr int64_t tile_bytes(int64_t bits) { return bits * 64 + 2 * 16 * 2; }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
constexpr bool kHasQuantLinear = true;

// quant_linear. Weights in groups of 32 inputs, w = q * d + m with q unsigned (4 bits: 0..15,
// GGML's Q4_1; 8 bits: 0..255, an int8 weight stored as q = w / d + 128 with m = -128 d) and
// d, m float16 per group and output. quant_pack lays them out in tiles of 16 outputs x 32
// inputs: registers whose byte (lane j, byte b) of register c holds input 4c + b of output j
// (4 bits: register c < 4 holds inputs 4c + b in its low nibbles and 4c + 16 + b in its high
// ones), then the 16 d and the 16 m. Activations are quantized per row and group to int8
// (x ~ xq * dx, as GGML's Q8_1), so that vpdpbusd multiplies 4 pairs per lane in integers:
//   y[n] = sum_g d[n,g] * dx[g] * sum_k q[n,k] xq[k]  +  m[n,g] * dx[g] * sum_k xq[k].
// Every row is computed alone, in the same order whatever the number of rows.

void quantize_rows_q8(const c10::BFloat16* x, int64_t M, int64_t K, int8_t* xq, float* dx,
                      float* sx) {
  const int64_t G = K / 32;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        const auto* src = reinterpret_cast<const __m256i*>(x + m * K + g * 32);
        const __m512 a = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src)), 16));
        const __m512 b = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(src + 1)), 16));
        const float amax =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        int8_t* dst = xq + m * K + g * 32;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qb));
        dx[m * G + g] = d;
        sx[m * G + g] =
            d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
      }
    }
  });
}

constexpr int64_t kPrefetchGroups = 8;

// NR rows x 16 outputs over all K / 32 groups of one column of tiles.
template <int Bits, int NR>
void quant_rows(const uint8_t* tile, int64_t groups, const int8_t* const* xq,
                const float* const* dx, const float* const* sx, c10::BFloat16* const* y) {
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
  for (int r = 0; r < NR; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[r]), (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

constexpr int kQuantRows = 8;
using QuantRowsFn = void (*)(const uint8_t*, int64_t, const int8_t* const*, const float* const*,
                             const float* const*, c10::BFloat16* const*);
template <int Bits>
constexpr QuantRowsFn kQuantRowFns[kQuantRows] = {
    quant_rows<Bits, 1>, quant_rows<Bits, 2>, quant_rows<Bits, 3>, quant_rows<Bits, 4>,
    quant_rows<Bits, 5>, quant_rows<Bits, 6>, quant_rows<Bits, 7>, quant_rows<Bits, 8>};
#else
constexpr bool kHasQuantLinear = false;
#endif

// K and V rows [T, Hkv, W] (rows contiguous) into the slots of cache [2, Hkv, slots, W]: the
// same bytes as index_copy_ from a stacked, transposed copy, moved row by row.
void store_kv(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2 && cache.is_contiguous(), "cache shape");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == cache.size(1) &&
                  k.size(2) == cache.size(3), "k and v must be [T, Hkv, W]");
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
              "k, v and cache dtypes differ");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v rows must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0), "slots");
  const int64_t T = k.size(0), Hkv = k.size(1), W = k.size(2), S = cache.size(2);
  const int64_t es = cache.element_size(), row = W * es;
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "slot out of range");
    for (int64_t h = 0; h < Hkv; ++h) {
      std::memcpy(dst + ((0 * Hkv + h) * S + sp[t]) * row,
                  kp + (t * k.stride(0) + h * k.stride(1)) * es, row);
      std::memcpy(dst + ((1 * Hkv + h) * S + sp[t]) * row,
                  vp + (t * v.stride(0) + h * v.stride(1)) * es, row);
    }
  }
}

constexpr int64_t kParamsPerLayer = 18;

}  // namespace

// run_layers: every decoder layer of a step in one call, the same ATen and kernel calls as the
// Python modules make (so the same results), without the Python between them. Per layer,
// `params` holds: input norm weight; qkv, o, gate_up and down as (weight, quantized, scales,
// bias); post-attention norm weight (see LlamaForCausalLM.fused_params). The attention inputs
// are those of TorchPagedAttention's metadata: decode rows (`dec_idx` into the step's rows, or
// every row when there are no spans), their block tables [Bd, nb] and context lengths; prompt
// spans [S, 3] (first row, end row, context length) with a block table each.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& cache,
                             const at::Tensor& table, int64_t ctx_len, int64_t block_size,
                             double scale);

static at::Tensor layer_attention(const at::Tensor& q, const at::Tensor& cache,
                                  const at::Tensor& dec_idx, const at::Tensor& dec_tables,
                                  const at::Tensor& dec_lens, const at::Tensor& spans,
                                  const std::vector<at::Tensor>& span_tables,
                                  int64_t block_size, double scale) {
  const int64_t S = spans.numel() ? spans.size(0) : 0;
  if (S == 0)
    return decode_attention(q.contiguous(), cache, dec_tables, dec_lens, block_size, scale);
  auto out = at::empty_like(q);
  if (dec_idx.numel())
    out.index_put_({dec_idx}, decode_attention(q.index({dec_idx}).contiguous(), cache,
                                               dec_tables, dec_lens, block_size, scale));
  const auto sp = spans.contiguous();
  const int64_t* b = sp.data_ptr<int64_t>();
  for (int64_t i = 0; i < S; ++i) {
    const int64_t start = b[3 * i], n = b[3 * i + 1] - start;
    out.narrow(0, start, n).copy_(prefill_attention(q.narrow(0, start, n).contiguous(), cache,
                                                    span_tables[i], b[3 * i + 2], block_size,
                                                    scale));
  }
  return out;
}

at::Tensor run_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                      const std::vector<at::Tensor>& params,
                      const std::vector<at::Tensor>& caches, const at::Tensor& slots,
                      const at::Tensor& dec_idx, const at::Tensor& dec_tables,
                      const at::Tensor& dec_lens, const at::Tensor& spans,
                      const std::vector<at::Tensor>& span_tables, int64_t block_size,
                      double scale, int64_t heads, int64_t kv_heads, double eps,
                      int64_t small_batch, int64_t int4_group) {
  const int64_t L = static_cast<int64_t>(caches.size());
  TORCH_CHECK(static_cast<int64_t>(params.size()) == L * kParamsPerLayer, "params per layer");
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, hidden]");
  TORCH_CHECK(static_cast<int64_t>(span_tables.size()) == (spans.numel() ? spans.size(0) : 0),
              "one block table per span");
  const int64_t T = x.size(0), D = cos.size(-1);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* p = params.data() + l * kParamsPerLayer;
    const at::Tensor& cache = caches[l];
    auto qkv = linear(rms_norm(x, p[0], eps), p + 1, small_batch, int4_group)
                   .view({T, heads + 2 * kv_heads, D});
    auto qk_in = qkv.narrow(1, 0, heads + kv_heads);
    auto qk = at::addcmul(qk_in * cos, qk_in.roll({D / 2}, {-1}), sin);
    store_kv(cache, slots, qk.narrow(1, heads, kv_heads),
             qkv.narrow(1, heads + kv_heads, kv_heads));
    auto attn = layer_attention(qk.narrow(1, 0, heads), cache, dec_idx, dec_tables, dec_lens,
                                spans, span_tables, block_size, scale);
    x = x + linear(attn.flatten(1), p + 5, small_batch, int4_group);
    auto gate_up = linear(rms_norm(x, p[9], eps), p + 10, small_batch, int4_group).chunk(2, -1);
    x = x + linear(at::silu(gate_up[0]) * gate_up[1], p + 14, small_batch, int4_group);
  }
  return x;
}

// quant_pack: q [N, K] uint8 (0..15 for bits 4, 0..255 for bits 8), d and m [N, K / 32] ->
// quant_linear's tiles, [N / 16, K / 32, tile bytes] uint8 (N a multiple of 16, K of 32).
bool has_quant_linear() { return kHasQuantLinear; }

at::Tensor quant_pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                      int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "q must be [N, K] uint8");
  const int64_t N = q.size(0), K = q.size(1), G = K / 32;
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "quant_pack needs N % 16 == 0 and K % 32 == 0");
  auto qc = q.contiguous();
  auto dh = d.to(at::kHalf).contiguous(), mh = m.to(at::kHalf).contiguous();
  TORCH_CHECK(dh.dim() == 2 && dh.size(0) == N && dh.size(1) == G && mh.sizes() == dh.sizes(),
              "d and m must be [N, K / 32]");
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
        std::memcpy(tile + bits * 64 + 2 * j, dp + (t * 16 + j) * G + g, 2);
        std::memcpy(tile + bits * 64 + 32 + 2 * j, mp + (t * 16 + j) * G + g, 2);
      }
    }
  }
  return out;
}

// quant_linear: x [M, K] bf16 times quant_pack's tiles [N / 16, K / 32, tile bytes] (the
// tile size tells 4 from 8 bits) -> [M, N] bf16.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(kHasQuantLinear, "quant_linear needs AVX512-VNNI and AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) * 32 == x.size(1), "packed weight shape");
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0), G = K / 32, N = T * 16;
  const int64_t tb = packed.size(2);
  TORCH_CHECK(tb == tile_bytes(4) || tb == tile_bytes(8), "not quant_pack's tiles");
  auto out = at::empty({M, N}, x.options());
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  auto xc = x.contiguous();
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * G), sx(M * G);
  quantize_rows_q8(xc.data_ptr<c10::BFloat16>(), M, K, xq.data(), dx.data(), sx.data());
  const QuantRowsFn* fns = tb == tile_bytes(4) ? kQuantRowFns<4> : kQuantRowFns<8>;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  c10::BFloat16* yp = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r0 = 0; r0 < M; r0 += kQuantRows) {
        const int64_t nr = std::min<int64_t>(kQuantRows, M - r0);
        const int8_t* xr[kQuantRows];
        const float *dr[kQuantRows], *sr[kQuantRows];
        c10::BFloat16* yr[kQuantRows];
        for (int64_t r = 0; r < nr; ++r) {
          xr[r] = xq.data() + (r0 + r) * K;
          dr[r] = dx.data() + (r0 + r) * G;
          sr[r] = sx.data() + (r0 + r) * G;
          yr[r] = yp + (r0 + r) * N + t * 16;
        }
        fns[nr - 1](wp + t * G * tb, G, xr, dr, sr, yr);
      }
    }
  });
#endif
  return out;
}

// prefill_attention: a prompt chunk's causal attention over its request's paged context, bf16
// with AVX512-BF16 only (`has_prefill_attention`); see prefill_attention_impl.
bool has_prefill_attention() { return kHasPrefillAttention; }

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& cache,
                             const at::Tensor& table, int64_t ctx_len, int64_t block_size,
                             double scale) {
  TORCH_CHECK(kHasPrefillAttention, "prefill_attention needs AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 4 && cache.size(0) == 2, "bad shapes");
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && cache.scalar_type() == at::kBFloat16,
              "prefill_attention supports bfloat16");
  TORCH_CHECK(cache.size(3) == q.size(2) && q.size(2) % 32 == 0, "unsupported head_dim");
  TORCH_CHECK(q.size(1) % cache.size(1) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 1, "table must be int64");
  TORCH_CHECK(ctx_len >= q.size(0) && table.size(0) * block_size >= ctx_len,
              "the table must cover the context, the chunk included");
  auto out = at::empty_like(q);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  prefill_attention_impl(q, cache, table.contiguous(), ctx_len, block_size, scale, out);
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The compute entries release the GIL: they touch no Python object, and a decode step's
  // run_layers runs for milliseconds, during which the server's event loop must be free
  // to stream the previous step's tokens and take new requests.
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU)", nogil());
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension of a 2-D tensor (CPU)",
        nogil());
  m.def("has_prefill_attention", &has_prefill_attention, "whether prefill_attention is built");
  m.def("prefill_attention", &prefill_attention, "causal attention of a prompt chunk (CPU)",
        nogil());
  m.def("has_quant_linear", &has_quant_linear, "whether quant_linear is built");
  m.def("quant_pack", &quant_pack, "pack int4/int8 weights for quant_linear", nogil());
  m.def("quant_linear", &quant_linear, "x @ W.T, W packed int4/int8 (CPU, AVX512-VNNI)",
        nogil());
  m.def("store_kv", &store_kv, "write K/V rows into their cache slots (CPU)", nogil());
  m.def("run_layers", &run_layers, "all decoder layers of a step (CPU)", nogil());
}
