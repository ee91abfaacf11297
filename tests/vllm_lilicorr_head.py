"""vLLM's own LiLiCorrHead on saved weights and inputs, for test_lilicorr's parity check.

Run as `python -m tests.vllm_lilicorr_head INPUTS OUT [INPUTS OUT ...]` in a process of its
own: it sets up vLLM's model-parallel state, which an in-process engine of the test session
would meet.
"""

import sys
import tempfile

import torch
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.config.compilation import CompilationMode
from vllm.distributed import init_distributed_environment, initialize_model_parallel


def edge_scores(data: dict) -> torch.Tensor:
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.models.lilicorr import LiLiCorrHead

    head = LiLiCorrHead(model_hidden_size=data["model_hidden_size"],
                        block_size=data["block_size"], rms_norm_eps=data["eps"],
                        config=data["config"])
    names = set(dict(head.named_parameters()))
    assert names == set(data["state"]), names ^ set(data["state"])
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.copy_(data["state"][name])
    # vLLM's load order: its inference copies first, then the CPU GEMM's weight packing.
    head.materialize_inference_buffers(torch.device("cpu"), torch.float32)
    for module in head.modules():
        if isinstance(module, LinearBase):
            module.quant_method.process_weights_after_loading(module)
    with torch.no_grad():
        return head(*data["args"])


def main(paths: list[str]) -> None:
    eager = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    with set_current_vllm_config(eager):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)
        for inputs_path, out_path in zip(paths[::2], paths[1::2], strict=True):
            torch.save(edge_scores(torch.load(inputs_path)), out_path)


if __name__ == "__main__":
    main(sys.argv[1:])
