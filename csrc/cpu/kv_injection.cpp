// KV injection, CPU: torch.ops.vllm_dflash_cpu.kv_injection_write, the math of the CUDA kernel
// (../kv_injection.cu): k_norm (RMSNorm over head_dim) + neox RoPE of K and the paged write of
// K and V, every draft layer in one call, in place of ~20 torch ops (kv_injection_torch).
#include <cmath>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "../kv_injection_args.h"
#include "ops.h"

namespace vllm_dflash {
namespace {

template <typename T>
void write_token(const KvInjectionParams& p, int64_t token) {
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;
  const int D = p.head_dim, half = D / 2;
  const float* cos = p.cos_sin_cache + p.positions[token] * D;
  const float* sin = cos + half;
  const int64_t kv_width = static_cast<int64_t>(p.num_kv_heads) * D;
  for (int layer = 0; layer < p.num_layers; ++layer) {
    const T* weight = static_cast<const T*>(p.k_norm_weight) + layer * D;
    const T* layer_kv = static_cast<const T*>(p.kv) + (token * p.num_layers + layer) * 2 * kv_width;
    const int64_t* stride = p.cache_stride[layer];
    T* slot_base = static_cast<T*>(p.cache[layer]) + (slot / p.block_size) * stride[0] +
                   (slot % p.block_size) * stride[2];
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const T* k = layer_kv + static_cast<int64_t>(h) * D;
      const T* v = k + kv_width;
      T* dst = slot_base + h * stride[1];
      float sum_sq = 0.f;
      for (int i = 0; i < D; ++i) sum_sq += static_cast<float>(k[i]) * static_cast<float>(k[i]);
      const float inv_rms = 1.0f / std::sqrt(sum_sq / D + p.eps);
      for (int i = 0; i < half; ++i) {
        const float x1 = static_cast<float>(k[i]) * inv_rms * static_cast<float>(weight[i]);
        const float x2 =
            static_cast<float>(k[i + half]) * inv_rms * static_cast<float>(weight[i + half]);
        dst[i * stride[3]] = static_cast<T>(x1 * cos[i] - x2 * sin[i]);
        dst[(i + half) * stride[3]] = static_cast<T>(x2 * cos[i] + x1 * sin[i]);
      }
      for (int i = 0; i < D; ++i) dst[(D + i) * stride[3]] = v[i];
    }
  }
}

}  // namespace

void kv_injection_write(const at::Tensor& kv, const at::Tensor& positions,
                        const at::Tensor& slot_mapping, const at::Tensor& k_norm_weight,
                        double eps, const at::Tensor& cos_sin_cache,
                        const std::vector<at::Tensor>& kv_caches) {
  TORCH_CHECK(kv.device().is_cpu(), "kv must be a CPU tensor");
  const KvInjectionParams p = kv_injection_params(kv, positions, slot_mapping, k_norm_weight,
                                                  eps, cos_sin_cache, kv_caches);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv.scalar_type(), "kv_injection", [&] {
    // Tokens write disjoint slots (vLLM gives each token its own).
    at::parallel_for(0, p.num_tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t token = begin; token < end; ++token) write_token<scalar_t>(p, token);
    });
  });
}

}  // namespace vllm_dflash
