"""One drafter pass over blocks, conditioned on a prefix of target features (pure torch)."""

import torch

from vllm_dflash.model import DFlashDrafter, dense_attend


def draft_pass(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    block_ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [Tq, H] and logits [Tq, V] of block tokens at positions, attending per
    mask [Tq, Tc + Tq]; Tq holds equal blocks of the drafter's block_size.

    features [Tc, K*H] are the target's features of positions 0 .. Tc-1 (the context). Inputs
    are cast to the drafter's dtype (a drafter may train in fp32 against a bf16 target).
    """
    dtype = drafter.fc.weight.dtype
    if not torch.is_autocast_enabled(features.device.type):
        # Under autocast the matmul casts the lm_head itself: a copy of it in the drafter's
        # dtype would only take memory. (drafter.embed casts the rows it looks up.)
        lm_head_weight = lm_head_weight.to(dtype)
    context = drafter.fuse(features.to(dtype))
    context_kv = drafter.context_kv(context, torch.arange(len(features), device=features.device))
    attend = dense_attend(context_kv, mask, drafter.scale)
    hidden = drafter(drafter.embed(block_ids, embed_weight), positions, attend,
                     block_len=drafter.cfg.block_size)
    return hidden, drafter.logits(hidden, lm_head_weight)
