"""vLLM's model executor, as the drafter uses it: the target's embedding and lm_head (under
LoRA too, or a bf16 copy of the head) and vLLM's CPU GEMM for the drafter's linear layers."""

from collections.abc import Callable
from functools import partial

import torch

from vllm_dflash.vllm.config import DRAFT_HEAD_ENV, IMPL_ENV, DFlashSetupError


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
    embed_tokens, lm_head, logits_processor = _base_head_layers(
        target, "vllm-dflash with LoRA", f"Run without --enable-lora, or set {IMPL_ENV}=vllm.")
    return embed_tokens, lambda hidden: logits_processor(lm_head, hidden)


def bf16_draft_head(target: torch.nn.Module) -> Callable:
    """hidden states -> bf16 draft logits through a bf16 copy of the target's lm_head (its
    vocabulary rows, not the padding), with the target's soft cap and logit scale, run as the
    drafter's layers run (vLLM's CPU GEMM on CPU). The target's own head stays for
    verification."""
    _, lm_head, processor = _base_head_layers(
        target, f"{DRAFT_HEAD_ENV}=bfloat16", f"Unset {DRAFT_HEAD_ENV}.")
    weight = getattr(lm_head, "weight", None)
    if weight is None or not weight.is_floating_point():
        raise DFlashSetupError(
            f"{DRAFT_HEAD_ENV}=bfloat16 copies the target's lm_head weight, but "
            f"{type(lm_head).__name__} has no floating-point weight (a quantized head?); unset "
            f"{DRAFT_HEAD_ENV}.")
    weight = weight[: processor.org_vocab_size]
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16,
                           device=weight.device)
    head.weight.data.copy_(weight)
    if weight.device.type == "cpu":
        use_vllm_cpu_gemm(head)

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = head(hidden.to(torch.bfloat16))
        if processor.soft_cap is not None:
            out = torch.tanh(out / processor.soft_cap) * processor.soft_cap
        return out * processor.scale if processor.scale != 1.0 else out

    return logits


def _base_head_layers(target: torch.nn.Module, what: str,
                      fix: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """The target's embedding, lm_head and logits processor (their base layers under LoRA)."""
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
            f"{what} needs the target's base embedding and lm_head, but "
            f"{type(model).__name__} has no {', '.join(missing)}. {fix}"
        )
    return base(inner.embed_tokens), base(model.lm_head), base(model.logits_processor)


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
