"""vLLM's model executor, as the drafter uses it: the target's embedding and lm_head (under
LoRA too) and vLLM's CPU GEMM for the drafter's linear layers."""

from collections.abc import Callable
from functools import partial

import torch

from vllm_dflash.vllm.config import IMPL_ENV, DFlashSetupError


def target_head(target: torch.nn.Module, lora: bool) -> tuple[Callable, Callable]:
    """The target's token embedding and logits, as the drafter calls them: ids -> embeddings,
    hidden states -> logits.

    With LoRA on, vLLM wraps the embedding, lm_head and logits processor in adapter layers that
    index the target's own batch of tokens; the drafter's batch is another, so it runs their
    base layers. Adapters apply to the target alone: verification by the adapted target keeps
    the output exact, only acceptance can change.
    """
    if not lora:
        return target.embed_input_ids, target.compute_logits
    from vllm.lora.layers import BaseLayerWithLoRA

    def base(module: torch.nn.Module) -> torch.nn.Module:
        return module.base_layer if isinstance(module, BaseLayerWithLoRA) else module

    model = target.get_language_model() if hasattr(target, "get_language_model") else target
    inner = getattr(model, "model", None)
    found = {"model.embed_tokens": hasattr(inner, "embed_tokens"),
             "lm_head": hasattr(model, "lm_head"),
             "logits_processor": hasattr(model, "logits_processor")}
    missing = [name for name, present in found.items() if not present]
    if missing:
        raise DFlashSetupError(
            f"vllm-dflash with LoRA needs the target's base embedding and lm_head, but "
            f"{type(model).__name__} has no {', '.join(missing)}. Run without --enable-lora, or "
            f"set {IMPL_ENV}=vllm."
        )
    embed_tokens, lm_head = base(inner.embed_tokens), base(model.lm_head)
    logits_processor = base(model.logits_processor)
    return embed_tokens, lambda hidden: logits_processor(lm_head, hidden)


def use_vllm_cpu_gemm(module: torch.nn.Module) -> None:
    """Runs every nn.Linear of `module` through vLLM's CPU GEMM, as vLLM's own linear layers
    do: oneDNN on a weight packed once at load (2.2-2.4x torch's F.linear at the test
    drafter's shapes on an AMD EPYC, whose MKL path is slow), where vLLM's build has it. The
    unpacked weights are freed as vLLM frees its own, so read any (kv_weight) before."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for linear in module.modules():
        if isinstance(linear, torch.nn.Linear):
            dispatch_cpu_unquantized_gemm(linear, remove_weight=True)
            # The weight left is empty where packed (and unused), the layer's own otherwise.
            linear.forward = partial(linear.cpu_linear, weight=linear.weight, bias=linear.bias)
