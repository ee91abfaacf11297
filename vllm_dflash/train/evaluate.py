"""Mean acceptance length of a drafter: a small greedy speculative loop in pure torch.

Each step drafts one block [anchor, MASK x (B-1)] at the anchor's position, the target
verifies it (a full forward, no KV cache: the sequences are short), and the longest prefix of
drafts equal to the target's greedy tokens is accepted, plus the target's next token. The
tokens are exactly the target's greedy ones; tau is the mean of accepted + 1 over blocks.
"""

from functools import partial

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from vllm_dflash.draft_sampling import choose_drafts
from vllm_dflash.model import DFlashDrafter, SelectorInputs
from vllm_dflash.train.features import target_features
from vllm_dflash.train.forward import draft_pass

# The target's embedding and lm_head weights, which the drafter shares.
Head = tuple[torch.Tensor, torch.Tensor]


def target_head(target: PreTrainedModel) -> Head:
    return target.get_input_embeddings().weight, target.get_output_embeddings().weight


def draft_block(drafter: DFlashDrafter, head: Head, features: torch.Tensor, anchor: int
                ) -> list[int]:
    """B-1 greedy draft tokens following the anchor token, at position len(features)."""
    cfg, device = drafter.cfg, features.device
    embed_weight, lm_head_weight = head
    position = len(features)
    block_ids = torch.tensor([anchor] + [cfg.mask_token_id] * (cfg.block_size - 1), device=device)
    positions = torch.arange(position, position + cfg.block_size, device=device)
    mask = torch.ones(cfg.block_size, position + cfg.block_size, dtype=torch.bool, device=device)
    hidden, logits = draft_pass(
        drafter,
        features,
        block_ids,
        positions,
        mask,
        embed_weight,
        lm_head_weight,
    )
    # A LiLiCorr head reads the context state of the token before the anchor, the last one
    # with target features.
    inputs = SelectorInputs(block_ids[:1], drafter.fuse(features[-1:].to(hidden.dtype)),
                            partial(F.embedding, weight=embed_weight.to(hidden.dtype)))
    drafts, _ = choose_drafts(drafter.selector, hidden[None, 1:], logits[None, 1:], inputs)
    return drafts[0].tolist()


def speculative_greedy(
    drafter: DFlashDrafter, target: PreTrainedModel, prompt: list[int], max_new_tokens: int,
    head: Head | None = None,
) -> tuple[list[int], list[int]]:
    """Greedy decoding of prompt with drafts: the token ids, and tokens produced per block.

    Stops after at least max_new_tokens new tokens or at eos; the ids equal plain greedy decoding.
    head: the target's embedding and lm_head weights, when the target's own are sharded.
    """
    head = head or target_head(target)
    layer_ids = drafter.cfg.target_layer_ids
    features, logits = target_features(target, prompt, layer_ids)
    ids = prompt + [int(logits[-1].argmax())]
    lengths: list[int] = []
    while len(ids) - len(prompt) < max_new_tokens and ids[-1] != target.config.eos_token_id:
        anchor_pos = len(ids) - 1
        drafts = draft_block(drafter, head, features[:anchor_pos], ids[-1])
        features, logits = target_features(target, ids + drafts, layer_ids)
        greedy = logits[anchor_pos:].argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
            accepted += 1
        ids += drafts[:accepted] + [greedy[accepted]]
        lengths.append(accepted + 1)
    return ids, lengths


@torch.no_grad()
def mean_acceptance_length(
    drafter: DFlashDrafter, target: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int,
    head: Head | None = None,
) -> float:
    """tau over all blocks of all prompts."""
    # In the drafter's dtype once for the whole evaluation, not per block (draft_pass casts).
    dtype = drafter.fc.weight.dtype
    head = tuple(w.to(dtype) for w in head or target_head(target))
    lengths = [
        n for p in prompts
        for n in speculative_greedy(drafter, target, p, max_new_tokens, head)[1]
    ]
    return sum(lengths) / max(1, len(lengths))
