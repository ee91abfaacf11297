// The CPU kernels of vllm_dflash._C_cpu, registered as torch.ops.vllm_dflash_cpu.* in
// torch_bindings.cpp. Contracts: the torch references in vllm_dflash/kernels/.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

namespace vllm_dflash {

at::Tensor draft_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& kv_cache, const at::Tensor& block_table,
                           const at::Tensor& context_lens, const at::Tensor& query_start_loc,
                           double scale, bool causal, int64_t sliding_window);

void kv_injection_write(const at::Tensor& kv, const at::Tensor& positions,
                        const at::Tensor& slot_mapping, const at::Tensor& k_norm_weight,
                        double eps, const at::Tensor& cos_sin_cache,
                        const std::vector<at::Tensor>& kv_caches);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace vllm_dflash
