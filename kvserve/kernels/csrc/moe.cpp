// The routing and the weighted sum of a mixture-of-experts layer, around the experts' matmuls
// (gguf_grouped, or each expert's own linear: layers.cpp's moe_mlp). Both compute what
// kvserve.models.moe computes in torch, bit for bit (the tests compare them):
//
// moe_route: router logits [T, E] -> softmax in float32 (torch's own, so its bits) -> each
//   row's k largest probabilities, ties to the lower expert id (a stable descending sort's
//   first k) -> with `normalize`, each divided by their sum, added in rank order one at a
//   time -> the k (weight, id) pairs in ascending id order. With `topk_softmax` (gpt-oss)
//   the k largest logits are chosen the same way and the weights are torch's softmax over
//   those k, in rank order.
//
// moe_combine: the experts' outputs y [S, H], slot (t, j) at row pos[t, j] -> out[t] =
//   sum_j float(y[pos[t, j]]) * w[t, j], added in j (= expert id) order starting from j = 0's
//   product, rounded once to y's dtype. Each row alone: a token's output does not depend on
//   which other tokens share the step or its experts.
#include "common.h"

#include <algorithm>
#include <vector>

// A product and the sum it goes into stay two roundings, as torch's separate ops make them.
#pragma GCC optimize("fp-contract=off")

namespace {

template <typename T>
void combine_rows(const at::Tensor& y, const at::Tensor& pos, const at::Tensor& w,
                  at::Tensor& out) {
  const int64_t Tn = pos.size(0), k = pos.size(1), H = y.size(1);
  const T* yp = y.data_ptr<T>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* wp = w.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, Tn, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(H);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const T* row = yp + pp[t * k + j] * H;
        const float wt = wp[t * k + j];
        if (j == 0) {
          for (int64_t h = 0; h < H; ++h) acc[h] = static_cast<float>(row[h]) * wt;
        } else {
          for (int64_t h = 0; h < H; ++h) {
            const float p = static_cast<float>(row[h]) * wt;
            acc[h] = acc[h] + p;
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) op[t * H + h] = static_cast<T>(acc[h]);
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t k,
                                             bool normalize, bool topk_softmax) {
  kvs::check_cpu("moe_route", logits);
  TORCH_CHECK(logits.dim() == 2 && k >= 1 && k <= logits.size(1),
              "moe_route: logits [T, E] and 1 <= k <= E");
  const auto scores = logits.to(at::kFloat).contiguous();
  const auto probs = topk_softmax ? scores : at::softmax(scores, -1);
  const int64_t Tn = probs.size(0), E = probs.size(1);
  auto weights = at::empty({Tn, k}, probs.options());
  auto ids = at::empty({Tn, k}, probs.options().dtype(at::kLong));
  const float* pp = probs.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<int64_t> rank(Tn * k);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < Tn; ++t) {
    const float* p = pp + t * E;
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    // the first k of a stable descending sort: the larger value first, then the lower id
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [p](int64_t a, int64_t b) {
      return p[a] > p[b] || (p[a] == p[b] && a < b);
    });
    std::copy(order.begin(), order.begin() + k, rank.begin() + t * k);
  }
  // Each row's k weights in rank order: topk_softmax's softmax over the chosen logits (one
  // torch call over [T, k], each row alone), else the probabilities, normalized or not.
  at::Tensor ranked;
  if (topk_softmax) {
    auto top = at::empty({Tn, k}, probs.options());
    float* tp = top.data_ptr<float>();
    for (int64_t i = 0; i < Tn * k; ++i) tp[i] = pp[(i / k) * E + rank[i]];
    ranked = at::softmax(top, -1);
  }
  std::vector<std::pair<int64_t, float>> chosen(k);
  for (int64_t t = 0; t < Tn; ++t) {
    const float* p = pp + t * E;
    const int64_t* r = rank.data() + t * k;
    if (topk_softmax) {
      const float* w = ranked.data_ptr<float>() + t * k;
      for (int64_t j = 0; j < k; ++j) chosen[j] = {r[j], w[j]};
    } else {
      float total = p[r[0]];
      for (int64_t j = 1; j < k; ++j) total = total + p[r[j]];
      for (int64_t j = 0; j < k; ++j) chosen[j] = {r[j], normalize ? p[r[j]] / total : p[r[j]]};
    }
    std::sort(chosen.begin(), chosen.end());  // by id (distinct)
    for (int64_t j = 0; j < k; ++j) {
      ip[t * k + j] = chosen[j].first;
      wp[t * k + j] = chosen[j].second;
    }
  }
  return {weights, ids};
}

at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& pos, const at::Tensor& weights) {
  kvs::check_cpu("moe_combine", y, pos, weights);
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && pos.dim() == 2 &&
                  pos.scalar_type() == at::kLong && pos.is_contiguous() &&
                  weights.sizes() == pos.sizes() && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(),
              "moe_combine: y [S, H], pos int64 [T, k], weights float32 [T, k]");
  const int64_t S = y.size(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < pos.numel(); ++i)
    TORCH_CHECK(pp[i] >= 0 && pp[i] < S, "moe_combine: a slot's row out of range");
  auto out = at::empty({pos.size(0), y.size(1)}, y.options());
  if (y.scalar_type() == at::kFloat)
    combine_rows<float>(y, pos, weights, out);
  else if (y.scalar_type() == at::kBFloat16)
    combine_rows<c10::BFloat16>(y, pos, weights, out);
  else
    TORCH_CHECK(false, "moe_combine: y must be float32 or bf16");
  return out;
}
