// CPU draft attention: torch.ops.vllm_dflash_cpu.draft_attention, the contract of
// vllm_dflash/kernels/draft_attention.py:draft_attention_reference (its test oracle).
//
// The torch fallback gathers every request's context out of the paged cache and runs ~50 ops a
// layer; at a few requests the op overhead alone is most of the drafter's attention time. Here
// one call reads the pages in place. Work item = (request, KV head, tile of kRows query rows);
// a row is (query, head in the KV head's group), so GQA heads share every key load.
// Per tile: scores = Q K^T over the keys any of its rows sees, a masked fp32 softmax, P V.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include "ops.h"

namespace vllm_dflash {
namespace {

// Query rows per tile: one hardware vector of floats (GCC/Clang vector extension) holds a key's
// scores for every row, so neither Q K^T nor P V needs horizontal sums.
#ifdef __AVX512F__
constexpr int kRows = 16;
#else
constexpr int kRows = 8;
#endif
using Rows = float __attribute__((vector_size(kRows * sizeof(float))));
using RowInts = int32_t __attribute__((vector_size(kRows * sizeof(int32_t))));
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (a score minus its row's max), 0 for -inf (a hidden key).
// std::exp does not vectorize without -ffast-math, whose no-infinities rule would break the
// mask; this is 2^t, t = x log2 e, with a degree-6 polynomial on t's fraction (relative error
// ~2e-7). t is clamped at -126, the smallest normal exponent: 2^-126 ~ 1e-38 stands for 0.
inline Rows exp_nonpositive(Rows x) {
  Rows t = x * 1.44269504088896341f;
  t = t > -126.0f ? t : Rows{} - 126.0f;
  RowInts n = __builtin_convertvector(t, RowInts);  // rounds toward 0: floor for t <= 0 ...
  n += t < __builtin_convertvector(n, Rows);         // ... once a non-integer t is lowered by 1
  const Rows f = t - __builtin_convertvector(n, Rows);
  Rows p = Rows{} + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  Rows scale;
  const RowInts bits = (n + 127) << 23;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x == kNegInf ? Rows{} : p * scale;
}

struct Problem {
  int num_kv_heads, group, head_dim, block_size;  // group: query heads per KV head
  int64_t q_stride[2], k_stride[2], v_stride[2], out_stride[2], cache_stride[3], table_stride;
  float scale;
  bool causal;
  int window;  // 0: no sliding window
};

template <typename T>
class Tile {
 public:
  Tile(const Problem& p, const T* q, const T* k, const T* v, const T* cache, const int* table,
       T* out)
      : p_(p), q_(q), k_(k), v_(v), cache_(cache), table_(table), out_(out),
        q_t_(p.head_dim), out_t_(p.head_dim) {}

  // Rows row0.. of request `req` (queries q_start.., q_len of them, after ctx_len context
  // tokens) for KV head kv_head.
  void run(int req, int kv_head, int q_start, int q_len, int ctx_len, int row0) {
    const int D = p_.head_dim, total = ctx_len + q_len;
    const int num_rows = std::min(kRows, q_len * p_.group - row0);
    // Each row sees the keys [row_lo, row_hi) in absolute positions (context, then block).
    RowInts row_lo, row_hi;
    int lo = total, hi = 0;
    std::fill(q_t_.begin(), q_t_.end(), Rows{});
    for (int r = 0; r < kRows; ++r) {
      const int row = row0 + std::min(r, num_rows - 1);  // padding rows repeat the last one
      const int qi = row / p_.group, head = kv_head * p_.group + row % p_.group;
      const int q_pos = ctx_len + qi;
      row_lo[r] = p_.window ? std::max(0, q_pos - p_.window + 1) : 0;
      row_hi[r] = p_.causal ? q_pos + 1 : (p_.window ? std::min(total, q_pos + p_.window) : total);
      lo = std::min(lo, row_lo[r]);
      hi = std::max(hi, row_hi[r]);
      const T* src = q_ + (q_start + qi) * p_.q_stride[0] + head * p_.q_stride[1];
      for (int d = 0; d < D; ++d) q_t_[d][r] = static_cast<float>(src[d]) * p_.scale;
    }
    const int num_keys = hi - lo;
    keys_.resize(num_keys);
    values_.resize(num_keys);
    scores_.resize(num_keys);
    if constexpr (!std::is_same_v<T, float>) buffer_.resize(static_cast<size_t>(num_keys) * 2 * D);
    for (int s = lo; s < hi; ++s) locate_kv(req, kv_head, q_start, ctx_len, s, s - lo);

    // scores[s] = (q_r . k_s for every row r), masked; 4 keys at a time for 4 independent sums.
    Rows row_max = Rows{} + kNegInf;
    int s = 0;
    for (; s + 4 <= num_keys; s += 4) {
      const float *k0 = keys_[s], *k1 = keys_[s + 1], *k2 = keys_[s + 2], *k3 = keys_[s + 3];
      Rows dot0{}, dot1{}, dot2{}, dot3{};
      for (int d = 0; d < D; ++d) {
        const Rows qd = q_t_[d];
        dot0 += k0[d] * qd, dot1 += k1[d] * qd, dot2 += k2[d] * qd, dot3 += k3[d] * qd;
      }
      row_max = mask_and_max(dot0, lo + s, row_lo, row_hi, &scores_[s], row_max);
      row_max = mask_and_max(dot1, lo + s + 1, row_lo, row_hi, &scores_[s + 1], row_max);
      row_max = mask_and_max(dot2, lo + s + 2, row_lo, row_hi, &scores_[s + 2], row_max);
      row_max = mask_and_max(dot3, lo + s + 3, row_lo, row_hi, &scores_[s + 3], row_max);
    }
    for (; s < num_keys; ++s) {
      Rows dot{};
      for (int d = 0; d < D; ++d) dot += keys_[s][d] * q_t_[d];
      row_max = mask_and_max(dot, lo + s, row_lo, row_hi, &scores_[s], row_max);
    }
    Rows row_sum{};
    for (Rows& score : scores_) {
      score = exp_nonpositive(score - row_max);
      row_sum += score;
    }

    // out_t[d] = sum_s v_s[d] p_s (every row at once), 4 dims at a time.
    int d = 0;
    for (; d + 4 <= D; d += 4) {
      Rows out0{}, out1{}, out2{}, out3{};
      for (int s = 0; s < num_keys; ++s) {
        const float* v = values_[s] + d;
        const Rows prob = scores_[s];
        out0 += v[0] * prob, out1 += v[1] * prob, out2 += v[2] * prob, out3 += v[3] * prob;
      }
      out_t_[d] = out0, out_t_[d + 1] = out1, out_t_[d + 2] = out2, out_t_[d + 3] = out3;
    }
    for (; d < D; ++d) {
      Rows out{};
      for (int s = 0; s < num_keys; ++s) out += values_[s][d] * scores_[s];
      out_t_[d] = out;
    }
    const Rows inv_sum = 1.0f / row_sum;
    for (int r = 0; r < num_rows; ++r) {
      const int qi = (row0 + r) / p_.group, head = kv_head * p_.group + (row0 + r) % p_.group;
      T* dst = out_ + (q_start + qi) * p_.out_stride[0] + head * p_.out_stride[1];
      for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(out_t_[d][r] * inv_sum[r]);
    }
  }

 private:
  static Rows mask_and_max(Rows dot, int key_pos, RowInts row_lo, RowInts row_hi, Rows* score,
                           Rows row_max) {
    *score = (key_pos >= row_lo && key_pos < row_hi) ? dot : Rows{} + kNegInf;
    return row_max > *score ? row_max : *score;
  }

  // keys_[i] / values_[i] = K / V of key position s, fp32: the paged context or the block,
  // read in place when the model is fp32, else converted into buffer_.
  void locate_kv(int req, int kv_head, int q_start, int ctx_len, int s, int i) {
    const T *key, *value;
    if (s < ctx_len) {
      const int64_t block = table_[req * p_.table_stride + s / p_.block_size];
      key = cache_ + block * p_.cache_stride[0] + kv_head * p_.cache_stride[1] +
            (s % p_.block_size) * p_.cache_stride[2];
      value = key + p_.head_dim;
    } else {
      const int j = q_start + s - ctx_len;
      key = k_ + j * p_.k_stride[0] + kv_head * p_.k_stride[1];
      value = v_ + j * p_.v_stride[0] + kv_head * p_.v_stride[1];
    }
    if constexpr (std::is_same_v<T, float>) {
      keys_[i] = key, values_[i] = value;
    } else {
      const int D = p_.head_dim;
      float* dst = &buffer_[static_cast<size_t>(i) * 2 * D];
      for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(key[d]);
      for (int d = 0; d < D; ++d) dst[D + d] = static_cast<float>(value[d]);
      keys_[i] = dst, values_[i] = dst + D;
    }
  }

  const Problem& p_;
  const T *q_, *k_, *v_, *cache_;
  const int* table_;
  T* out_;
  std::vector<Rows> q_t_, out_t_, scores_;  // [D], [D], [keys]: one value per row
  std::vector<const float*> keys_, values_;  // [keys]: each key's K and V, D floats
  std::vector<float> buffer_;                // [keys, 2D]: K and V converted to fp32
};

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& kv_cache, const at::Tensor& block_table,
                  const at::Tensor& context_lens, const at::Tensor& query_start_loc) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && kv_cache.dim() == 4,
              "q/k/v must be [T, H, D] and kv_cache [num_blocks, Hkv, block_size, 2D]");
  const int64_t D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(k.size(2) == D && v.sizes() == k.sizes() && k.size(0) == q.size(0) &&
                  q.size(1) % Hkv == 0,
              "k and v must be [T, Hkv, D] with q's T and D, and Hkv dividing q's heads");
  TORCH_CHECK(kv_cache.size(1) == Hkv && kv_cache.size(3) == 2 * D,
              "kv_cache must be [num_blocks, Hkv, block_size, 2D]");
  for (const at::Tensor* t : {&q, &k, &v, &kv_cache}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == q.scalar_type(),
                "q, k, v and kv_cache must be CPU tensors of one dtype");
    TORCH_CHECK(t->stride(-1) == 1, "the last dim of q, k, v and kv_cache must be contiguous");
  }
  for (const at::Tensor* t : {&block_table, &context_lens, &query_start_loc}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kInt,
                "block_table, context_lens and query_start_loc must be CPU int32 tensors");
  }
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1 &&
                  context_lens.is_contiguous() && query_start_loc.is_contiguous() &&
                  block_table.size(0) == context_lens.size(0) &&
                  query_start_loc.size(0) == context_lens.size(0) + 1,
              "block_table [N, max_blocks] (rows contiguous), context_lens [N], "
              "query_start_loc [N+1]");
}

}  // namespace

at::Tensor draft_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& kv_cache, const at::Tensor& block_table,
                           const at::Tensor& context_lens, const at::Tensor& query_start_loc,
                           double scale, bool causal, int64_t sliding_window) {
  check_inputs(q, k, v, kv_cache, block_table, context_lens, query_start_loc);
  at::Tensor out = at::empty_like(q);
  Problem p;
  p.num_kv_heads = static_cast<int>(k.size(1));
  p.group = static_cast<int>(q.size(1)) / p.num_kv_heads;
  p.head_dim = static_cast<int>(q.size(2));
  p.block_size = static_cast<int>(kv_cache.size(2));
  for (int d = 0; d < 2; ++d) {
    p.q_stride[d] = q.stride(d), p.k_stride[d] = k.stride(d);
    p.v_stride[d] = v.stride(d), p.out_stride[d] = out.stride(d);
  }
  for (int d = 0; d < 3; ++d) p.cache_stride[d] = kv_cache.stride(d);
  p.table_stride = block_table.stride(0);
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.window = static_cast<int>(sliding_window);

  const int num_requests = static_cast<int>(context_lens.size(0));
  const int* ctx = context_lens.data_ptr<int>();
  const int* starts = query_start_loc.data_ptr<int>();
  // Work items: every (request, KV head, row tile); a request of q_len queries has
  // ceil(q_len * group / kRows) tiles.
  std::vector<int> item_req, item_row0;
  for (int r = 0; r < num_requests; ++r) {
    for (int row0 = 0; row0 < (starts[r + 1] - starts[r]) * p.group; row0 += kRows) {
      item_req.push_back(r);
      item_row0.push_back(row0);
    }
  }
  const int64_t num_items = static_cast<int64_t>(item_req.size()) * p.num_kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "draft_attention", [&] {
    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
      Tile<scalar_t> tile(p, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                          v.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(),
                          block_table.data_ptr<int>(), out.data_ptr<scalar_t>());
      for (int64_t i = begin; i < end; ++i) {
        const int item = static_cast<int>(i / p.num_kv_heads);
        const int kv_head = static_cast<int>(i % p.num_kv_heads), r = item_req[item];
        tile.run(r, kv_head, starts[r], starts[r + 1] - starts[r], ctx[r], item_row0[item]);
      }
    });
  });
  return out;
}

}  // namespace vllm_dflash
