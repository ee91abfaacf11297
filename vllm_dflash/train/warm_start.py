"""A drafter started from the target's own layers (`vllm-dflash train --init-from-target`).

The drafter's context K/V in its first layer is `k_proj(hidden_norm(fc(features)))`. With fc
passing only the deepest feature k through and hidden_norm holding the input norm of target
layer k+1, that is exactly target layer k+1's K/V of the context; the drafter's layers then
start as target layers k+1, k+2, ... and its final norm as the target's. Training starts from
the target's next-token computation instead of from noise.
"""

import torch
from transformers import PreTrainedModel

from vllm_dflash.model import DFlashDrafter


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
