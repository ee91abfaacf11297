"""Drafters that do not start from noise: from the target's own layers (`vllm-dflash train
--init-from-target`), or from a saved drafter, to train it further (`--from-drafter`).

The drafter's context K/V in its first layer is `k_proj(hidden_norm(fc(features)))`. With fc
passing only the deepest feature k through and hidden_norm holding the input norm of target
layer k+1, that is exactly target layer k+1's K/V of the context; the drafter's layers then
start as target layers k+1, k+2, ... and its final norm as the target's. Training starts from
the target's next-token computation instead of from noise.
"""

from dataclasses import asdict
from pathlib import Path

import torch
from transformers import PreTrainedModel

from vllm_dflash.checkpoint import load_drafter
from vllm_dflash.model import DFlashDrafter

# What a saved drafter must share with the one the options describe for its weights to fit.
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "vocab_size", "block_size", "mask_token_id", "target_layer_ids",
                "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                "lilicorr")


def source_layers(drafter: DFlashDrafter, num_target_layers: int) -> list[int]:
    """The target layers the drafter's layers start from: those after its deepest feature."""
    deepest = max(drafter.cfg.target_layer_ids)
    first = deepest + 1
    count = len(drafter.layers)
    if first + count > num_target_layers:
        raise ValueError(
            f"--init-from-target copies target layers {first}..{first + count - 1} (after the "
            f"deepest feature {deepest}), but the target has {num_target_layers}; fix: pass "
            f"--target-layer-ids whose largest id is at most {num_target_layers - count - 1}, "
            "or fewer --layers"
        )
    return list(range(first, first + count))


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, target: PreTrainedModel) -> list[int]:
    """Copy target layers after the deepest feature into the drafter (in place); fc selects
    that feature. Parameters the target's layers lack (Llama has no q/k norm) keep their
    initial values; target parameters the drafter lacks (attention biases) are not copied.
    Returns the target layer ids copied."""
    decoder = target.get_decoder()
    ids = source_layers(drafter, len(decoder.layers))
    for layer, k in zip(drafter.layers, ids, strict=True):
        source = decoder.layers[k].state_dict()
        for name, param in layer.named_parameters():
            if name in source:
                param.copy_(source[name].to(param.dtype))
    hidden = drafter.cfg.hidden_size
    deepest = drafter.cfg.target_layer_ids.index(max(drafter.cfg.target_layer_ids))
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, deepest * hidden:(deepest + 1) * hidden] = torch.eye(hidden)
    drafter.hidden_norm.weight.copy_(decoder.layers[ids[0]].input_layernorm.weight)
    drafter.norm.weight.copy_(decoder.norm.weight)
    return ids


@torch.no_grad()
def init_from_drafter(drafter: DFlashDrafter, path: str | Path) -> None:
    """Copy a saved drafter's weights into drafter (in place), both in the same shapes."""
    saved = load_drafter(path, dtype=torch.float32)
    want, have = asdict(drafter.cfg), asdict(saved.cfg)
    differ = [f"{k} {have.get(k)} (options: {want.get(k)})" for k in SHAPE_FIELDS
              if have.get(k) != want.get(k)]
    if differ:
        raise ValueError(
            f"--from-drafter {path} has other shapes than these options give: "
            f"{'; '.join(differ)}; fix: pass the --layers, --block-size, --target-layer-ids, "
            "--mask-token-id (and --dflash2 / --lilicorr) it was trained with")
    drafter.load_state_dict(saved.state_dict())
