// torch.ops.vllm_dflash_cpu.*: the CPU kernels. Its own namespace, so that this extension and
// the CUDA one (torch.ops.vllm_dflash.*) can both load in one process.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(vllm_dflash_cpu, m) {
  m.def(
      "draft_attention(Tensor q, Tensor k, Tensor v, Tensor kv_cache, Tensor block_table, "
      "Tensor context_lens, Tensor query_start_loc, float scale, bool causal, "
      "int sliding_window) -> Tensor");
  m.def(
      "kv_injection_write(Tensor kv, Tensor positions, Tensor slot_mapping, "
      "Tensor k_norm_weight, float eps, Tensor cos_sin_cache, Tensor(a!)[] kv_caches) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotate(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_dflash_cpu, CPU, m) {
  m.impl("draft_attention", &vllm_dflash::draft_attention);
  m.impl("kv_injection_write", &vllm_dflash::kv_injection_write);
  m.impl("rms_norm", &vllm_dflash::rms_norm);
  m.impl("rotate", &vllm_dflash::rotate);
}

#include "../python_module.h"  // PyInit__C_cpu
