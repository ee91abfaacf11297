// KV injection, CUDA: k_norm (RMSNorm over head_dim) + neox RoPE of K and the paged write of
// K and V, for every draft layer in one launch. Same contract as kv_injection_reference in
// vllm_dflash/kernels/kv_injection.py.
//
// Draft attention has no CUDA version on purpose: it is a flash-style GEMM kernel, which Triton
// compiles to tensor-core code (wgmma on Hopper) with online softmax; a hand-written CUDA
// kernel only pays if it matches that (mma/wgmma tiling, async copies), a large amount of code
// for a kernel that is not the bottleneck of the draft step. KV injection is different: it is
// small, launch-bound elementwise work, where a precompiled kernel avoids Triton's per-launch
// host overhead and the device-side pointer table (cache pointers travel in the parameters).

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "kv_injection.h"

namespace vllm_dflash {
namespace {

constexpr int kWarpSize = 32;
constexpr int kMaxWarps = 8;

// grid (T, L); one warp per KV head (looping when Hkv > kMaxWarps).
template <typename scalar_t>
__global__ void kv_injection_kernel(const KvInjectionParams p) {
  const int64_t token = blockIdx.x;
  const int layer = blockIdx.y;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;
  const int head_dim = p.head_dim;
  const int half = head_dim / 2;
  const int lane = threadIdx.x % kWarpSize;

  const float* cos = p.cos_sin_cache + p.positions[token] * head_dim;
  const float* sin = cos + half;
  const scalar_t* weight = static_cast<const scalar_t*>(p.k_norm_weight) + layer * head_dim;
  const int64_t* stride = p.cache_stride[layer];
  scalar_t* slot_base = static_cast<scalar_t*>(p.cache[layer]) +
                        (slot / p.block_size) * stride[0] + (slot % p.block_size) * stride[2];
  const int64_t kv_width = static_cast<int64_t>(p.num_kv_heads) * head_dim;
  const scalar_t* layer_kv =
      static_cast<const scalar_t*>(p.kv) + (token * p.num_layers + layer) * 2 * kv_width;

  for (int h = threadIdx.x / kWarpSize; h < p.num_kv_heads; h += blockDim.x / kWarpSize) {
    const scalar_t* k = layer_kv + static_cast<int64_t>(h) * head_dim;
    const scalar_t* v = k + kv_width;
    scalar_t* dst = slot_base + h * stride[1];

    float sum_sq = 0.f;
    for (int i = lane; i < head_dim; i += kWarpSize) {
      const float x = static_cast<float>(k[i]);
      sum_sq += x * x;
    }
    for (int m = kWarpSize / 2; m > 0; m /= 2) sum_sq += __shfl_xor_sync(0xffffffff, sum_sq, m);
    const float inv_rms = rsqrtf(sum_sq / head_dim + p.eps);

    for (int i = lane; i < half; i += kWarpSize) {
      const float x1 = static_cast<float>(k[i]) * inv_rms * static_cast<float>(weight[i]);
      const float x2 =
          static_cast<float>(k[i + half]) * inv_rms * static_cast<float>(weight[i + half]);
      dst[i * stride[3]] = static_cast<scalar_t>(x1 * cos[i] - x2 * sin[i]);
      dst[(i + half) * stride[3]] = static_cast<scalar_t>(x2 * cos[i] + x1 * sin[i]);
    }
    for (int i = lane; i < head_dim; i += kWarpSize) dst[(head_dim + i) * stride[3]] = v[i];
  }
}

}  // namespace

template <typename scalar_t>
void launch_kv_injection(const KvInjectionParams& params, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(params.num_tokens), params.num_layers);
  const int warps = params.num_kv_heads < kMaxWarps ? params.num_kv_heads : kMaxWarps;
  kv_injection_kernel<scalar_t><<<grid, warps * kWarpSize, 0, stream>>>(params);
}

template void launch_kv_injection<float>(const KvInjectionParams&, cudaStream_t);
template void launch_kv_injection<double>(const KvInjectionParams&, cudaStream_t);
template void launch_kv_injection<c10::Half>(const KvInjectionParams&, cudaStream_t);
template void launch_kv_injection<c10::BFloat16>(const KvInjectionParams&, cudaStream_t);

}  // namespace vllm_dflash
