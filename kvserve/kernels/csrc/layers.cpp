// The per-layer pieces of a decoder step on the CPU and `run_layers`, which runs every decoder
// layer of a step in one call: the same ATen and kernel calls as the Python modules make (so
// the same results), without ~50 us of Python per layer between them. The compute-heavy
// kernels live in attention.cpp and linear.cpp; this file also holds the module's bindings.
//
// rms_norm: x [N, C] -> x * rsqrt(mean(x^2) + eps) rounded to x's dtype, times the weight, as
// the reference computes it (float32 statistics), each row alone; with a float32 weight for
// bf16 x (Gemma), times the weight in float32 before the one rounding.
//
// store_kv: K/V rows into their cache slots (what index_copy_ does, without the stacked copy);
// float32 rows into a float16 or bf16 cache rounded to nearest even, as torch's .to() rounds.
#include "common.h"

#include <array>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include <ATen/record_function.h>
#include <torch/extension.h>
#include <pybind11/stl.h>

namespace {

template <typename T>
inline float value(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return p[i];
  } else {
    uint16_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    return kvs::bf16_to_float(bits);
  }
}

constexpr int64_t kLanes = 16;  // partial sums of the sum of squares, so the compiler vectorizes

template <typename T, typename W>
void rms_rows(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t N = x.size(0), C = x.size(1);
  const T* xp = x.data_ptr<T>();
  const W* wp = w.data_ptr<W>();
  T* op = out.data_ptr<T>();
  // Rows are cheap (C ~ 1k): split only when there are many of them.
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(C);
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t c = 0; c < C; ++c) row[c] = value(xp + i * C, c);
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
        if constexpr (std::is_same_v<T, W>) {
          const T normed = static_cast<T>(row[c] * r);  // rounded first, as the reference does
          o[c] = static_cast<T>(static_cast<float>(normed) * value(wp, c));
        } else {
          o[c] = static_cast<T>(row[c] * r * wp[c]);
        }
      }
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  kvs::check_cpu("rms_norm", x, weight);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(), "bad input");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight shape");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() || weight.scalar_type() == at::kFloat,
              "the weight must be x's dtype or float32");
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    rms_rows<float, float>(x, weight, eps, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    if (weight.scalar_type() == at::kFloat)
      rms_rows<c10::BFloat16, float>(x, weight, eps, out);
    else
      rms_rows<c10::BFloat16, c10::BFloat16>(x, weight, eps, out);
  } else {
    TORCH_CHECK(false, "rms_norm supports float32 and bfloat16");
  }
  return out;
}


// K and V rows [T, Hkv, W] (rows contiguous) into the slots of cache [2, Hkv, slots, W]: the
// same bytes as index_copy_ from a stacked, transposed copy, moved row by row. Float32 rows
// into a float16 or bf16 cache are rounded on the way (narrow_row): the bytes of
// index_copy_ from rows converted with .to(cache.dtype).
void store_kv(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  kvs::check_cpu("store_kv", cache, slots, k, v);
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2 && cache.is_contiguous(), "cache shape");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == cache.size(1) &&
                  k.size(2) == cache.size(3), "k and v must be [T, Hkv, W]");
  const auto kv = cache.scalar_type();
  const bool narrow = k.scalar_type() == at::kFloat && (kv == at::kHalf || kv == at::kBFloat16);
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == kv || narrow),
              "k and v must be in the cache's dtype, or float32 for a float16/bf16 cache");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v rows must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0), "slots");
  const int64_t T = k.size(0), Hkv = k.size(1), W = k.size(2), S = cache.size(2);
  const int64_t es = cache.element_size(), row = W * es, src_es = k.element_size();
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const auto put = [&](char* to, const char* from) {
    if (!narrow)
      std::memcpy(to, from, row);
    else if (kv == at::kHalf)
      kvs::narrow_row(reinterpret_cast<const float*>(from), reinterpret_cast<c10::Half*>(to), W);
    else
      kvs::narrow_row(reinterpret_cast<const float*>(from), reinterpret_cast<c10::BFloat16*>(to), W);
  };
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "slot out of range");
    for (int64_t h = 0; h < Hkv; ++h) {
      put(dst + ((0 * Hkv + h) * S + sp[t]) * row,
          kp + (t * k.stride(0) + h * k.stride(1)) * src_es);
      put(dst + ((1 * Hkv + h) * S + sp[t]) * row,
          vp + (t * v.stride(0) + h * v.stride(1)) * src_es);
    }
  }
}

// One layer's tensors by name, as the model builds them once (LlamaForCausalLM.fused_weights);
// an empty tensor stands for what a layer lacks. A linear is (weight, packed, scales, bias),
// or a GGUF file's own blocks (parts, their GGML types and row orders: gguf_linear).
struct LinearWeights {
  at::Tensor weight, packed, scales, bias;
  GGUFMatrix gguf;
};

// A sparse layer's MLP (kvserve.models.moe.SparseMoE); top_k 0 in a dense layer. The router
// and the shared expert's gate are dense tiles padded to 16 outputs (RouterLinear), cut to
// `experts` and 1 outputs.
struct MoEWeights {
  int64_t top_k = 0, experts = 0;
  bool normalize = false;
  bool topk_softmax = false;  // gpt-oss's gating: a softmax over the k chosen logits
  // The experts' biases stacked [E, 2I] and [E, H] (gpt-oss), for the grouped path; each
  // expert's own LinearWeights hold them too. Undefined: none.
  at::Tensor gate_up_bias, down_bias;
  LinearWeights router, shared_gate, shared_gate_up, shared_down;  // shared_*: Qwen2-MoE's
  std::vector<LinearWeights> gate_up, down;                         // one per expert
  bool grouped = false;  // every expert in GGUF blocks: gguf_grouped runs them together
};

struct LayerWeights {
  int64_t window = 0;       // the attention's sliding window (0: the whole context)
  bool local_rope = false;  // RoPE from the second tables (the sliding layers' own base)
  bool gelu = false;        // GELU (tanh) gating the MLP instead of SiLU
  // gpt-oss's clamped SwiGLU where swiglu_limit > 0 (see activate)
  double swiglu_alpha = 0, swiglu_limit = 0;
  at::Tensor sinks;  // the attention's sink logit per head (gpt-oss); empty: none
  at::Tensor input_norm, post_attention_norm;  // the attention's and the MLP's input norms
  at::Tensor attn_out_norm, mlp_out_norm;      // norms on their outputs (Gemma)
  at::Tensor q_norm, k_norm;  // per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
  LinearWeights qkv, o, gate_up, down;
  MoEWeights moe;
};

// Every layer's weights, held on the C++ side so a step passes one reference.
struct DecoderWeights {
  std::vector<LayerWeights> layers;
};

namespace {

// run_layers' phases: each a torch.profiler scope (kvserve::NAME) and a wall-clock total
// added to the caller's `phase_seconds` (the engine's step records read it).
enum Phase { kQkvProj, kAttention, kOProj, kMlp, kMoeRouter, kMoeExperts, kMoeCombine,
             kMoeShared, kPhases };
constexpr std::array<const char*, kPhases> kPhaseNames = {
    "qkv_proj", "attention", "o_proj", "mlp", "moe_router", "moe_experts", "moe_combine",
    "moe_shared_expert"};
using PhaseSeconds = std::array<double, kPhases>;

// Adds its scope's wall time to one phase of a call's totals.
struct PhaseTimer {
  double* total;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  explicit PhaseTimer(double* t) : total(t) {}
  ~PhaseTimer() {
    *total += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};
#define KVS_PHASE(phases, id, name)           \
  RECORD_USER_SCOPE("kvserve::" name);        \
  PhaseTimer kvs_phase_timer_(&(phases)[id])

// y = x W^T (+ b) as kvserve.layers.linear computes it: quant_pack's tiles (uint8/int8, 3-D) ->
// quant_linear; dense_pack's tiles (3-D, x's dtype) -> dense_linear; torch's int4 (uint8) or
// int8 packing (2-D) -> torch's kernel; nothing packed -> the plain weight.
at::Tensor linear(const at::Tensor& x, const LinearWeights& w, int64_t group) {
  const at::Tensor& q = w.packed;
  at::Tensor y;
  if (!w.gguf.parts.empty()) {
    y = gguf_linear(x, w.gguf.parts, w.gguf.types, w.gguf.rows, "");
  } else if (q.dim() == 3) {
    y = q.scalar_type() == at::kByte || q.scalar_type() == at::kChar ? quant_linear(x, q)
                                                                       : dense_linear(x, q);
  } else if (q.numel()) {
    y = q.scalar_type() == at::kByte ? at::_weight_int4pack_mm_for_cpu(x, q, group, w.scales)
                                     : at::_weight_int8pack_mm(x, q, w.scales);
  } else {
    y = at::linear(x, w.weight);
  }
  return w.bias.numel() ? y + w.bias : y;
}

// RMSNorm of each head's rows [T, n, D] (a slice of the qkv output) with one weight [D].
at::Tensor head_norm(const at::Tensor& heads, const at::Tensor& weight, double eps) {
  const auto shape = heads.sizes().vec();
  return rms_norm(heads.reshape({-1, shape.back()}).contiguous(), weight, eps).view(shape);
}

// An MLP's activation of its gate and up projections, as kvserve.layers.mlp.GatedMLP computes
// it, op for op: act(gate) * up with SiLU or GELU (tanh); or gpt-oss's clamped SwiGLU
// (limit > 0): gate clamped above at the limit, up to +-limit, (up + 1) * gate *
// sigmoid(alpha gate).
struct Activation {
  bool gelu = false;
  double alpha = 0, limit = 0;
};

at::Tensor activate(const at::Tensor& gate, const at::Tensor& up, const Activation& a) {
  if (a.limit > 0) {
    const auto g = at::clamp_max(gate, a.limit);
    const auto glu = g * at::sigmoid(g * a.alpha);
    return (at::clamp(up, -a.limit, a.limit) + 1) * glu;
  }
  return (a.gelu ? at::gelu(gate, "tanh") : at::silu(gate)) * up;
}

// down(act(gate(x), up(x))), as kvserve.layers.mlp.GatedMLP computes it.
at::Tensor gated_mlp(const at::Tensor& x, const LinearWeights& gate_up, const LinearWeights& down,
                     const Activation& act, int64_t group) {
  auto gu = linear(x, gate_up, group).chunk(2, -1);
  return linear(activate(gu[0], gu[1], act), down, group);
}

// The router's (or shared gate's) outputs: its padded tile's first n.
at::Tensor router_out(const at::Tensor& x, const LinearWeights& w, int64_t n, int64_t group) {
  auto y = linear(x, w, group);
  return y.size(1) == n ? y : y.narrow(1, 0, n).contiguous();
}

// A sparse layer's MLP on x [T, H], as SparseMoE.forward computes it: route; the step's T * k
// slots (slot t k + j: token t's j-th expert by id) grouped by expert, in slot order within
// one (a counting sort: stable); each used expert's gated MLP on its slots' rows, in one
// gguf_grouped call per matrix where the experts are GGUF blocks, else one after another;
// the weighted sum (moe_combine); plus the shared expert times sigmoid(its gate).
at::Tensor moe_mlp(const at::Tensor& x, const MoEWeights& m, const Activation& act,
                   int64_t group, PhaseSeconds& phases) {
  const int64_t T = x.size(0), k = m.top_k, S = T * k;
  if (T == 0) return at::zeros_like(x);
  at::Tensor weights, ids;
  {
    KVS_PHASE(phases, kMoeRouter, "moe_router");
    std::tie(weights, ids) = moe_route(router_out(x, m.router, m.experts, group), k, m.normalize,
                                       m.topk_softmax);
  }
  auto pos = at::empty({T, k}, ids.options());
  at::Tensor y;
  {
    KVS_PHASE(phases, kMoeExperts, "moe_experts");
    const int64_t* ip = ids.data_ptr<int64_t>();
    std::vector<int64_t> offsets(m.experts + 1, 0);
    for (int64_t s = 0; s < S; ++s) ++offsets[ip[s] + 1];
    for (int64_t e = 0; e < m.experts; ++e) offsets[e + 1] += offsets[e];
    auto token = at::empty({S}, ids.options());  // the token of each grouped row
    int64_t* pp = pos.data_ptr<int64_t>();
    int64_t* tp = token.data_ptr<int64_t>();
    std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t row = next[ip[s]]++;
      pp[s] = row;
      tp[row] = s / k;
    }
    const auto xs = x.index_select(0, token);
    if (m.grouped) {
      std::vector<const GGUFMatrix*> gate_up(m.experts), down(m.experts);
      for (int64_t e = 0; e < m.experts; ++e) {
        gate_up[e] = &m.gate_up[e].gguf;
        down[e] = &m.down[e].gguf;
      }
      // Each grouped row's expert, for the biases: what each expert's own linear adds.
      at::Tensor row_expert;
      if (m.gate_up_bias.defined() || m.down_bias.defined()) {
        row_expert = at::empty({S}, ids.options());
        int64_t* rp = row_expert.data_ptr<int64_t>();
        for (int64_t e = 0; e < m.experts; ++e)
          for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) rp[r] = e;
      }
      auto gu = gguf_grouped(xs, offsets, gate_up, "");
      if (m.gate_up_bias.defined()) gu = gu + m.gate_up_bias.index_select(0, row_expert);
      auto parts = gu.chunk(2, -1);
      y = gguf_grouped(activate(parts[0], parts[1], act), offsets, down, "");
      if (m.down_bias.defined()) y = y + m.down_bias.index_select(0, row_expert);
    } else {
      y = at::empty_like(xs);
      for (int64_t e = 0; e < m.experts; ++e) {
        const int64_t n = offsets[e + 1] - offsets[e];
        if (n == 0) continue;  // an expert no row uses is not read
        y.narrow(0, offsets[e], n)
            .copy_(gated_mlp(xs.narrow(0, offsets[e], n), m.gate_up[e], m.down[e], act, group));
      }
    }
  }
  at::Tensor out;
  {
    KVS_PHASE(phases, kMoeCombine, "moe_combine");
    out = moe_combine(y, pos, weights);
  }
  if (m.shared_gate_up.weight.numel() || m.shared_gate_up.packed.numel() ||
      !m.shared_gate_up.gguf.parts.empty()) {
    KVS_PHASE(phases, kMoeShared, "moe_shared_expert");
    const auto g = router_out(x, m.shared_gate, 1, group);
    const auto gate = at::softmax(at::cat({g, at::zeros_like(g)}, 1), 1).narrow(1, 0, 1);
    out = out + gate * gated_mlp(x, m.shared_gate_up, m.shared_down, act, group);
  }
  return out;
}

}  // namespace

// run_layers: the step's decoder layers, as LlamaForCausalLM's modules compute them; cos/sin
// are the RoPE tables of the step's positions, cos_local/sin_local those of the layers with
// `local_rope`. The attention inputs are paged_attention's: the step's sequences [S, 3]
// (first row, rows, context length); the slot mapping [T] and block tables [S, nb] come one
// for every layer, or one per layer (models whose sliding-window layers keep block tables of
// their own, see kv_cache/layout.py). Its phases are torch.profiler scopes named kvserve::*
// (qkv_proj, attention, o_proj, mlp; moe_router, moe_experts, moe_combine, moe_shared_expert):
// benchmarks/step_phases.py reads where a step's time goes from them. Each phase's wall time,
// summed over the layers, is also added to `phase_seconds` (float64, one per name of
// layer_phases()). Off the profiler, a phase costs a check of one
// thread-local flag and two clock reads.
at::Tensor run_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& cos_local, const at::Tensor& sin_local,
                      const DecoderWeights& weights, const std::vector<at::Tensor>& caches,
                      const std::vector<at::Tensor>& slots, const at::Tensor& seqs,
                      const std::vector<at::Tensor>& tables, int64_t block_size, double scale, int64_t heads, int64_t kv_heads,
                      double eps, int64_t int4_group, const at::Tensor& phase_seconds) {
  kvs::check_cpu("run_layers", x, cos, sin, cos_local, sin_local, seqs);
  kvs::check_cpu("run_layers", caches);
  kvs::check_cpu("run_layers", slots);
  kvs::check_cpu("run_layers", tables);
  TORCH_CHECK(weights.layers.size() == caches.size(), "one cache per layer");
  TORCH_CHECK(slots.size() == tables.size() && (slots.size() == 1 || slots.size() == caches.size()),
              "slot mappings and block tables: one, or one per layer");
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, hidden]");
  TORCH_CHECK(phase_seconds.device().is_cpu() && phase_seconds.is_contiguous() &&
                  phase_seconds.scalar_type() == at::kDouble && phase_seconds.numel() == kPhases,
              "phase_seconds: a contiguous float64 CPU tensor of ", kPhases, " values");
  const int64_t T = x.size(0), D = cos.size(-1);
  PhaseSeconds phases{};
  const auto out_norm = [eps](const at::Tensor& h, const at::Tensor& w) {
    return w.numel() ? rms_norm(h, w, eps) : h;
  };
  for (size_t l = 0; l < caches.size(); ++l) {
    const LayerWeights& w = weights.layers[l];
    const at::Tensor& cache = caches[l];
    const size_t g = slots.size() == 1 ? 0 : l;
    at::Tensor qkv, attn;
    {
      KVS_PHASE(phases, kQkvProj, "qkv_proj");
      qkv = linear(rms_norm(x, w.input_norm, eps), w.qkv, int4_group)
                .view({T, heads + 2 * kv_heads, D});
    }
    {
      KVS_PHASE(phases, kAttention, "attention");
      auto qk_in = w.q_norm.numel()
                       ? at::cat({head_norm(qkv.narrow(1, 0, heads), w.q_norm, eps),
                                  head_norm(qkv.narrow(1, heads, kv_heads), w.k_norm, eps)}, 1)
                       : qkv.narrow(1, 0, heads + kv_heads);
      const at::Tensor& c = w.local_rope ? cos_local : cos;
      const at::Tensor& s = w.local_rope ? sin_local : sin;
      auto qk = at::addcmul(qk_in * c, qk_in.roll({D / 2}, {-1}), s);
      store_kv(cache, slots[g], qk.narrow(1, heads, kv_heads),
               qkv.narrow(1, heads + kv_heads, kv_heads));
      attn = paged_attention(qk.narrow(1, 0, heads), cache, seqs, tables[g], block_size, scale,
                             w.window, w.sinks);  // empty: no sinks
    }
    {
      KVS_PHASE(phases, kOProj, "o_proj");
      x = x + out_norm(linear(attn.flatten(1), w.o, int4_group), w.attn_out_norm);
    }
    const auto h = rms_norm(x, w.post_attention_norm, eps);
    const Activation act{w.gelu, w.swiglu_alpha, w.swiglu_limit};
    if (w.moe.top_k) {
      x = x + out_norm(moe_mlp(h, w.moe, act, int4_group, phases), w.mlp_out_norm);
    } else {
      KVS_PHASE(phases, kMlp, "mlp");
      x = x + out_norm(gated_mlp(h, w.gate_up, w.down, act, int4_group), w.mlp_out_norm);
    }
  }
  double* total = phase_seconds.data_ptr<double>();
  for (int i = 0; i < kPhases; ++i) total[i] += phases[i];
  return x;
}

// The names of run_layers' phases, in the order of its `phase_seconds`.
std::vector<std::string> layer_phases() { return {kPhaseNames.begin(), kPhaseNames.end()}; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Classes are module_local: pybind11 registers types process-wide, and two variants of this
  // module (build_spec.py) may be loaded side by side (the tests compare them).
  // The compute entries release the GIL: they touch no Python object, and a decode step's
  // run_layers runs for milliseconds, during which the server's event loop must be free
  // to stream the previous step's tokens and take new requests.
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("isa", [] { return kvs::kAvx512 ? "AVX-512" : kvs::kAvx2 ? "AVX2" : "none"; },
        "the vector instruction set the kernels were built for");
  m.def("has_paged_attention", &has_paged_attention,
        "whether paged_attention is built for q in `dtype` and a cache in `kv`",
        py::arg("dtype"), py::arg("kv"));
  m.def("paged_attention", &paged_attention, "attention of a step's rows, paged K/V (CPU)",
        py::arg("q"), py::arg("cache"), py::arg("seqs"), py::arg("tables"),
        py::arg("block_size"), py::arg("scale"), py::arg("window") = 0,
        py::arg("sinks") = py::none(), nogil());
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension of a 2-D tensor (CPU)",
        nogil());
  m.def("has_dense_linear", &has_dense_linear, "whether dense_linear is built for this dtype");
  m.def("dense_pack", &dense_pack, "pack a float32/bf16 weight for dense_linear", nogil());
  m.def("dense_linear", &dense_linear, "x @ W.T, W packed by dense_pack (CPU)", nogil());
  m.def("dense_uses_amx", &dense_uses_amx, "whether a bf16 layer with k inputs runs on AMX");
  m.def("has_dense_half", &has_dense_half,
        "whether dense_linear reads 16-bit weights with float32 activations");
  m.def("dense_pack_half", &dense_pack_half, "pack a bf16/float16 weight for float32 x",
        nogil());
  m.def("has_quant_linear", &has_quant_linear, "whether quant_linear is built");
  m.def("has_quant_halves", &has_quant_halves,
        "whether quant_linear reads 8-bit codes with a scale per 16 inputs");
  m.def("quant_pack", &quant_pack, "pack int4/int8 weights for quant_linear", nogil());
  m.def("quant_linear", &quant_linear, "x @ W.T, W packed int4/int8 (CPU, AVX512-VNNI)",
        nogil());
  m.def("store_kv", &store_kv, "write K/V rows into their cache slots (CPU)", nogil());
  m.def("gguf_supports", &gguf_supports, "whether gguf_linear reads this GGML type");
  m.def("gguf_path", &gguf_path, "the path gguf_linear takes here (VNNI, AVX2 or portable)");
  m.def("gguf_paths", &gguf_paths, "the paths gguf_linear can take here, best first");
  m.def("gguf_linear", &gguf_linear, "x @ W.T, W a GGUF file's own blocks (CPU)", py::arg("x"),
        py::arg("parts"), py::arg("types"), py::arg("rows"), py::arg("path") = "", nogil());
  m.def("gguf_grouped",
        [](const at::Tensor& x, const std::vector<int64_t>& offsets,
           const std::vector<std::vector<at::Tensor>>& parts,
           const std::vector<std::vector<int64_t>>& types,
           const std::vector<std::vector<at::Tensor>>& rows, const std::string& path) {
          TORCH_CHECK(parts.size() == types.size() && rows.size() == parts.size(),
                      "gguf_grouped: parts, types and rows for every matrix");
          std::vector<GGUFMatrix> mats;
          for (size_t e = 0; e < parts.size(); ++e) mats.push_back({parts[e], types[e], rows[e]});
          std::vector<const GGUFMatrix*> ptrs;
          for (const auto& w : mats) ptrs.push_back(&w);
          return gguf_grouped(x, offsets, ptrs, path);
        },
        "x's rows offsets[e] .. offsets[e + 1] - 1 times GGUF matrix e (CPU)", py::arg("x"),
        py::arg("offsets"), py::arg("parts"), py::arg("types"), py::arg("rows"),
        py::arg("path") = "", nogil());
  m.def("moe_route", &moe_route, "router logits -> (weights, expert ids), k per row (CPU)",
        py::arg("logits"), py::arg("k"), py::arg("normalize"), py::arg("topk_softmax") = false,
        nogil());
  m.def("moe_combine", &moe_combine, "each token's experts' outputs, weighted, summed (CPU)",
        py::arg("y"), py::arg("pos"), py::arg("weights"), nogil());
  m.def("gguf_rows", &gguf_rows, "rows of a GGUF tensor, dequantized as gguf does (CPU)",
        py::arg("part"), py::arg("type"), py::arg("k"), py::arg("ids"), py::arg("dtype"),
        nogil());
  m.def("gguf_repacked_type", &gguf_repacked_type,
        "the interleaved layout gguf_repack makes of a GGML type (its type id), or 0");
  m.def("gguf_repack", &gguf_repack, "rows of a GGUF tensor, 8 at a time interleaved (CPU)",
        py::arg("part"), py::arg("type"), py::arg("k"), py::arg("order"), py::arg("out"),
        nogil());
  py::class_<LinearWeights>(m, "LinearWeights", py::module_local())
      .def(py::init([](at::Tensor weight, at::Tensor packed, at::Tensor scales, at::Tensor bias,
                       std::vector<at::Tensor> parts, std::vector<int64_t> types,
                       std::vector<at::Tensor> rows) {
             return LinearWeights{weight, packed, scales, bias, GGUFMatrix{parts, types, rows}};
           }),
           py::arg("weight"), py::arg("packed"), py::arg("scales"), py::arg("bias"),
           py::arg("parts") = std::vector<at::Tensor>{},
           py::arg("types") = std::vector<int64_t>{},
           py::arg("rows") = std::vector<at::Tensor>{});
  py::class_<MoEWeights>(m, "MoEWeights", py::module_local())
      .def(py::init([](int64_t top_k, bool normalize, LinearWeights router,
                       std::vector<LinearWeights> gate_up, std::vector<LinearWeights> down,
                       LinearWeights shared_gate, LinearWeights shared_gate_up,
                       LinearWeights shared_down, bool topk_softmax) {
             TORCH_CHECK(top_k >= 1 && !gate_up.empty() && gate_up.size() == down.size() &&
                             top_k <= static_cast<int64_t>(gate_up.size()),
                         "MoEWeights: 1 <= top_k <= experts, a gate_up and a down per expert");
             MoEWeights m;
             m.top_k = top_k;
             m.experts = static_cast<int64_t>(gate_up.size());
             m.normalize = normalize;
             m.topk_softmax = topk_softmax;
             m.router = std::move(router);
             m.gate_up = std::move(gate_up);
             m.down = std::move(down);
             m.shared_gate = std::move(shared_gate);
             m.shared_gate_up = std::move(shared_gate_up);
             m.shared_down = std::move(shared_down);
             m.grouped = true;
             for (size_t e = 0; e < m.gate_up.size(); ++e)
               m.grouped = m.grouped && !m.gate_up[e].gguf.parts.empty() &&
                           !m.down[e].gguf.parts.empty();
             // Biases on every expert or on none (stacked for the grouped path).
             const auto stack = [](const std::vector<LinearWeights>& ws, const char* what) {
               std::vector<at::Tensor> b;
               for (const auto& w : ws)
                 if (w.bias.numel()) b.push_back(w.bias);
               TORCH_CHECK(b.empty() || b.size() == ws.size(),
                           "MoEWeights: ", what, " biases on some experts only");
               return b.empty() ? at::Tensor() : at::stack(b);
             };
             m.gate_up_bias = stack(m.gate_up, "gate_up");
             m.down_bias = stack(m.down, "down");
             return m;
           }),
           py::kw_only(), py::arg("top_k"), py::arg("normalize"), py::arg("router"),
           py::arg("gate_up"), py::arg("down"), py::arg("shared_gate"),
           py::arg("shared_gate_up"), py::arg("shared_down"), py::arg("topk_softmax") = false)
      .def_readonly("top_k", &MoEWeights::top_k, "experts a token uses (0: a dense layer)")
      .def_readonly("grouped", &MoEWeights::grouped,
                    "whether the experts run together on gguf_grouped");
  py::class_<LayerWeights>(m, "LayerWeights", py::module_local())
      .def(py::init([](int64_t window, bool local_rope, bool gelu, at::Tensor input_norm,
                       at::Tensor post_attention_norm, at::Tensor attn_out_norm,
                       at::Tensor mlp_out_norm, at::Tensor q_norm, at::Tensor k_norm,
                       LinearWeights qkv, LinearWeights o, LinearWeights gate_up,
                       LinearWeights down, MoEWeights moe, at::Tensor sinks,
                       double swiglu_alpha, double swiglu_limit) {
             LayerWeights w;
             w.window = window;
             w.local_rope = local_rope;
             w.gelu = gelu;
             w.swiglu_alpha = swiglu_alpha;
             w.swiglu_limit = swiglu_limit;
             w.sinks = std::move(sinks);
             w.input_norm = std::move(input_norm);
             w.post_attention_norm = std::move(post_attention_norm);
             w.attn_out_norm = std::move(attn_out_norm);
             w.mlp_out_norm = std::move(mlp_out_norm);
             w.q_norm = std::move(q_norm);
             w.k_norm = std::move(k_norm);
             w.qkv = std::move(qkv);
             w.o = std::move(o);
             w.gate_up = std::move(gate_up);
             w.down = std::move(down);
             w.moe = std::move(moe);
             return w;
           }),
           py::kw_only(), py::arg("window"), py::arg("local_rope"), py::arg("gelu"),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("attn_out_norm"),
           py::arg("mlp_out_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("moe") = MoEWeights{},
           py::arg("sinks") = at::empty({0}), py::arg("swiglu_alpha") = 0.0,
           py::arg("swiglu_limit") = 0.0)
      .def_readonly("moe", &LayerWeights::moe);
  py::class_<DecoderWeights>(m, "DecoderWeights", py::module_local())
      .def(py::init<std::vector<LayerWeights>>(), py::arg("layers"))
      .def_readonly("layers", &DecoderWeights::layers);
  m.def("run_layers", &run_layers, "all decoder layers of a step (CPU)", nogil());
  m.def("layer_phases", &layer_phases, "the names of run_layers' phases, in phase_seconds order");
}
