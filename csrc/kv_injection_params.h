// The arguments of a KV-injection kernel (CUDA: kv_injection.cu, CPU: cpu/kv_injection.cpp) as
// plain pointers and strides; plain C++, no torch headers.
#pragma once

#include <cstdint>

namespace vllm_dflash {

constexpr int kMaxLayers = 32;

struct KvInjectionParams {
  const void* kv;  // [T, L, 2, Hkv * D] contiguous, output of the fused k/v GEMM
  const int64_t* positions;  // [T]
  const int64_t* slot_mapping;  // [T], slot < 0: skip
  const void* k_norm_weight;  // [L, D] contiguous, kv's dtype
  const float* cos_sin_cache;  // [max_pos, D]: cos in [:D/2], sin in [D/2:]
  float eps;
  int64_t num_tokens;
  int num_layers, num_kv_heads, head_dim, block_size;
  // Per-layer cache [num_blocks, Hkv, block_size, 2 * D]: base pointer and strides (block,
  // head, slot, dim) in elements. Passed by value in the kernel parameters: no device table.
  void* cache[kMaxLayers];
  int64_t cache_stride[kMaxLayers][4];
};

}  // namespace vllm_dflash
