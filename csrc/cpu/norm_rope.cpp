// RMSNorm and RoPE for the drafter's CPU inference: torch.ops.vllm_dflash_cpu.{rms_norm,rotate},
// the math of vllm_dflash/layers.py:{rms_norm,rotate} (their references) in one op each instead
// of ~7 (at a few requests a draft layer is mostly op overhead).
#include <cmath>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "ops.h"

namespace vllm_dflash {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && weight.is_contiguous() &&
                  weight.dim() == 1 && x.size(-1) == weight.size(0) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: x [..., D] contiguous CPU, weight [D] with x's dtype");
  at::Tensor out = at::empty_like(x);
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = src + r * D;
        float sum_sq = 0.f;
        for (int64_t i = 0; i < D; ++i) sum_sq += static_cast<float>(row[i]) * static_cast<float>(row[i]);
        const float inv_rms = 1.0f / std::sqrt(sum_sq / D + static_cast<float>(eps));
        // As the reference: normalize in fp32, round to x's dtype, then scale in that dtype.
        for (int64_t i = 0; i < D; ++i) {
          dst[r * D + i] = w[i] * static_cast<scalar_t>(static_cast<float>(row[i]) * inv_rms);
        }
      }
    });
  });
  return out;
}

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1,
              "rotate: x must be a CPU [T, heads, D] tensor, last dim contiguous");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == T && t->size(1) == 1 && t->size(2) == D,
                "rotate: cos and sin must be contiguous fp32 [T, 1, D] (layers.rope_tables)");
  }
  at::Tensor out = at::empty({T, H, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rotate", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const float* c = cos.data_ptr<float>();
    const float* s = sin.data_ptr<float>();  // first half negated
    at::parallel_for(0, T * H, 64, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t t = row / H;
        const scalar_t* in = src + t * x.stride(0) + (row % H) * x.stride(1);
        const float* ct = c + t * D;
        const float* st = s + t * D;
        scalar_t* o = dst + row * D;
        for (int64_t i = 0; i < D; ++i) {
          const float swapped = static_cast<float>(in[i < half ? i + half : i - half]);
          o[i] = static_cast<scalar_t>(static_cast<float>(in[i]) * ct[i] + swapped * st[i]);
        }
      }
    });
  });
  return out;
}

}  // namespace vllm_dflash
