// torch.ops.vllm_dflash.* : argument checks and registration of the CUDA kernels.
// Importing vllm_dflash._C (built by setup.py) loads them.
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kv_injection.h"
#include "kv_injection_args.h"

namespace vllm_dflash {

void kv_injection_write(const at::Tensor& kv, const at::Tensor& positions,
                        const at::Tensor& slot_mapping, const at::Tensor& k_norm_weight,
                        double eps, const at::Tensor& cos_sin_cache,
                        const std::vector<at::Tensor>& kv_caches) {
  TORCH_CHECK(kv.is_cuda(), "kv must be a CUDA tensor");
  const KvInjectionParams p = kv_injection_params(kv, positions, slot_mapping, k_norm_weight,
                                                  eps, cos_sin_cache, kv_caches);
  if (p.num_tokens == 0) return;

  const c10::cuda::CUDAGuard guard(kv.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv.scalar_type(), "kv_injection",
                                  [&] { launch_kv_injection<scalar_t>(p, stream); });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace vllm_dflash

TORCH_LIBRARY(vllm_dflash, m) {
  m.def(
      "kv_injection_write(Tensor kv, Tensor positions, Tensor slot_mapping, "
      "Tensor k_norm_weight, float eps, Tensor cos_sin_cache, Tensor(a!)[] kv_caches) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_dflash, CUDA, m) {
  m.impl("kv_injection_write", &vllm_dflash::kv_injection_write);
}

#include "python_module.h"  // PyInit__C
