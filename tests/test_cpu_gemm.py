"""The drafter served on vLLM's CPU GEMM (plugin.use_vllm_cpu_gemm: oneDNN on packed weights)
computes what the pure torch drafter computes."""

import copy

import torch

from vllm_dflash.model import block_mask, dense_attend
from vllm_dflash.tiny import random_drafter
from vllm_dflash.vllm.model_executor import use_vllm_cpu_gemm


@torch.inference_mode()
def test_drafter_on_vllm_cpu_gemm_equals_torch(make_config) -> None:
    cfg = make_config(num_layers=2)
    drafter = random_drafter(cfg, seed=0)
    served = copy.deepcopy(drafter)
    use_vllm_cpu_gemm(served)

    torch.manual_seed(0)
    features = torch.randn(13, cfg.num_features * cfg.hidden_size)
    block = torch.randn(cfg.block_size, cfg.hidden_size)
    context_positions = torch.arange(13)
    block_positions = torch.arange(13, 13 + cfg.block_size)

    def run(model):
        context = model.context_kv(model.fuse(features), context_positions)
        mask = block_mask(13, cfg.block_size, causal=False, window=None)
        return model(block, block_positions, dense_attend(context, mask, model.scale))

    torch.testing.assert_close(run(served), run(drafter), atol=1e-5, rtol=0.0)
    # vLLM's x86 CPU build packs every weight for oneDNN and frees the unpacked one, as for its
    # own layers.
    from vllm import _custom_ops as ops

    assert ops._supports_onednn
    linears = [m for m in served.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 1 + 7 * cfg.num_layers  # fc; q, k, v, o, gate, up, down per layer
    assert all(m.weight.numel() == 0 for m in linears)
