// Launcher of the KV-injection CUDA kernel (kv_injection.cu); the torch op that calls it is in
// torch_bindings.cpp. This header and the .cu need no torch headers beyond c10's scalar types.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

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

// scalar_t (of kv, k_norm_weight and the caches): float, double, c10::Half, c10::BFloat16.
template <typename scalar_t>
void launch_kv_injection(const KvInjectionParams& params, cudaStream_t stream);

}  // namespace vllm_dflash
