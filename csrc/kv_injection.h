// Launcher of the KV-injection CUDA kernel (kv_injection.cu); the torch op that calls it is in
// torch_bindings.cpp. This header and the .cu need no torch headers beyond c10's scalar types.
#pragma once

#include <cuda_runtime_api.h>

#include "kv_injection_params.h"

namespace vllm_dflash {

// scalar_t (of kv, k_norm_weight and the caches): float, double, c10::Half, c10::BFloat16.
template <typename scalar_t>
void launch_kv_injection(const KvInjectionParams& params, cudaStream_t stream);

}  // namespace vllm_dflash
