// The torch op's argument checks, shared by the CUDA and CPU KV-injection ops: tensors in,
// KvInjectionParams out. The caller checks the device.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

#include "kv_injection_params.h"

namespace vllm_dflash {

inline KvInjectionParams kv_injection_params(const at::Tensor& kv, const at::Tensor& positions,
                                             const at::Tensor& slot_mapping,
                                             const at::Tensor& k_norm_weight, double eps,
                                             const at::Tensor& cos_sin_cache,
                                             const std::vector<at::Tensor>& kv_caches) {
  KvInjectionParams p;
  p.num_tokens = kv.size(0);
  p.num_layers = static_cast<int>(kv_caches.size());
  TORCH_CHECK(p.num_layers >= 1 && p.num_layers <= kMaxLayers, "1..", kMaxLayers, " layers");
  p.num_kv_heads = static_cast<int>(kv_caches[0].size(1));
  p.block_size = static_cast<int>(kv_caches[0].size(2));
  p.head_dim = static_cast<int>(k_norm_weight.size(1));
  TORCH_CHECK(kv.is_contiguous() && kv.dim() == 4 && kv.size(1) == p.num_layers &&
                  kv.size(2) == 2 && kv.size(3) == p.num_kv_heads * p.head_dim &&
                  p.head_dim % 2 == 0,
              "kv must be a contiguous [T, L, 2, Hkv*D] tensor, D even");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() &&
                  positions.device() == kv.device() && slot_mapping.device() == kv.device(),
              "positions and slot_mapping must be contiguous int64 on kv's device");
  TORCH_CHECK(k_norm_weight.is_contiguous() && k_norm_weight.scalar_type() == kv.scalar_type() &&
                  k_norm_weight.size(0) == p.num_layers && k_norm_weight.device() == kv.device(),
              "k_norm_weight must be a contiguous [L, D] tensor with kv's dtype and device");
  TORCH_CHECK(cos_sin_cache.is_contiguous() && cos_sin_cache.scalar_type() == at::kFloat &&
                  cos_sin_cache.size(1) == p.head_dim && cos_sin_cache.device() == kv.device(),
              "cos_sin_cache must be a contiguous fp32 [max_pos, D] tensor on kv's device");
  for (int l = 0; l < p.num_layers; ++l) {
    const at::Tensor& cache = kv_caches[l];
    TORCH_CHECK(cache.dim() == 4 && cache.size(1) == p.num_kv_heads &&
                    cache.size(2) == p.block_size && cache.size(3) == 2 * p.head_dim &&
                    cache.scalar_type() == kv.scalar_type() && cache.device() == kv.device(),
                "kv cache ", l, " must be [num_blocks, Hkv, block_size, 2*D] with kv's dtype");
    p.cache[l] = cache.data_ptr();
    for (int d = 0; d < 4; ++d) p.cache_stride[l][d] = cache.stride(d);
  }
  p.kv = kv.data_ptr();
  p.positions = positions.data_ptr<int64_t>();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.k_norm_weight = k_norm_weight.data_ptr();
  p.cos_sin_cache = cos_sin_cache.data_ptr<float>();
  p.eps = static_cast<float>(eps);
  return p;
}

}  // namespace vllm_dflash
