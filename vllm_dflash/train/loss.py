"""The drafter's loss on one training sequence: its blocks at given anchors, one forward; and
per mask position, how many of the blocks' greedy tokens are right (from the same logits).

SequenceLoss makes it a module's forward: the unit DDP wraps, since DDP prepares the gradient
sync of a backward in the forward that precedes it.
"""

from functools import partial

import torch
import torch.nn.functional as F

from vllm_dflash.model import DFlashDrafter, SelectorInputs
from vllm_dflash.train.blocks import (
    block_inputs,
    block_loss,
    block_mask,
    lattice_loss,
    loss_weights,
    position_hits,
    selector_loss,
)
from vllm_dflash.train.forward import draft_pass


def sequence_loss(
    drafter: DFlashDrafter,
    token_ids: list[int],
    anchors: torch.Tensor,
    features: torch.Tensor,
    frozen: tuple[torch.Tensor, torch.Tensor],
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted block loss of the blocks at anchors of one sequence (one forward), and its
    [B-1] position_hits."""
    B, device = drafter.cfg.block_size, features.device
    ids = torch.tensor(token_ids)
    block_ids, positions, labels = block_inputs(ids, anchors, B, drafter.cfg.mask_token_id)
    mask = block_mask(anchors, B, len(ids))
    hidden, logits = draft_pass(
        drafter, features, block_ids.to(device), positions.to(device), mask.to(device), *frozen
    )
    weights = loss_weights(B, gamma)
    loss = block_loss(logits, labels.to(device), weights)
    if drafter.candidate_selector is not None:
        loss = loss + selector_loss(drafter.candidate_selector, hidden, logits, block_ids,
                                    labels, weights)
    if drafter.lilicorr is not None:
        embed_weight = frozen[0].to(hidden.dtype)
        inputs = SelectorInputs(block_ids.view(-1, B)[:, 0].to(device),
                                drafter.fuse(features[anchors.to(device) - 1].to(hidden.dtype)),
                                partial(F.embedding, weight=embed_weight))
        loss = loss + lattice_loss(drafter.lilicorr, hidden, logits, labels, weights, inputs)
    return loss, position_hits(logits, labels, B)


class SequenceLoss(torch.nn.Module):
    """sequence_loss of a drafter against the target's frozen embedding and lm_head."""

    def __init__(
        self, drafter: DFlashDrafter, frozen: tuple[torch.Tensor, torch.Tensor], gamma: float
    ) -> None:
        super().__init__()
        self.drafter, self.frozen, self.gamma = drafter, frozen, gamma

    def forward(
        self, token_ids: list[int], anchors: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(anchors) == 0:
            # A rank joins every gradient sync, also with no block to learn from: a zero loss
            # that reaches every parameter.
            zero = sum(p.sum() for p in self.parameters()) * 0.0
            return zero, torch.zeros(self.drafter.cfg.block_size - 1, device=features.device)
        return sequence_loss(self.drafter, token_ids, anchors, features, self.frozen, self.gamma)
