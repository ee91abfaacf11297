"""The target model (HF transformers) and its hidden states at the drafter's layers.

Feature id k is the output of decoder layer k, i.e. `output_hidden_states[k + 1]`. Features of
each training sequence are computed once and kept in memory, or in a disk cache keyed by the
target, the layer ids and the token ids; or, online, computed for each batch as it trains.
"""

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel


def load_target(path: str, dtype: torch.dtype, device: str) -> PreTrainedModel:
    """The frozen target in eval mode."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    return model


@torch.no_grad()
def target_features(
    model: PreTrainedModel, token_ids: list[int], layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [T, K*H] of the layers layer_ids and the target's logits [T, V]."""
    ids = torch.tensor([token_ids], device=model.device)
    with recorded_layers(model, layer_ids) as outputs:
        logits = model(input_ids=ids).logits
    return layer_features(outputs, layer_ids), logits[0]


@torch.no_grad()
def context_features(
    model: PreTrainedModel, token_ids: list[int], layer_ids: list[int]
) -> torch.Tensor:
    """Features [T, K*H] of the layers layer_ids, from the decoder alone: training needs no
    target logits, and the lm_head is a fifth of a small target's forward pass."""
    return batch_context_features(model, [token_ids], layer_ids)[0]


@torch.no_grad()
def batch_context_features(
    model: PreTrainedModel, sequences: list[list[int]], layer_ids: list[int]
) -> list[torch.Tensor]:
    """context_features of each sequence, from one forward of them right-padded: causal
    attention keeps the padding out of every real position."""
    lengths = [len(s) for s in sequences]
    ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, token_ids in enumerate(sequences):
        ids[row, : len(token_ids)] = torch.tensor(token_ids)
        mask[row, : len(token_ids)] = 1
    with recorded_layers(model, layer_ids) as outputs:
        model.get_decoder()(input_ids=ids.to(model.device), attention_mask=mask.to(model.device))
    return [layer_features(outputs, layer_ids, row)[:n] for row, n in enumerate(lengths)]


@contextmanager
def recorded_layers(model: PreTrainedModel, layer_ids: list[int]
                    ) -> Iterator[dict[int, torch.Tensor]]:
    """Feature k of each id in layer_ids, from a forward run inside: `output_hidden_states[k +
    1]` as transformers gives it, the output of decoder layer k, and for the last layer the
    decoder's output after its final norm. Recorded by forward hooks: transformers' own
    output_hidden_states records nothing once FSDP has wrapped the layers (--fsdp-target)."""
    outputs: dict[int, torch.Tensor] = {}

    def record(k: int, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        outputs[k] = output if isinstance(output, torch.Tensor) else output[0]

    decoder = model.get_decoder()
    last = len(decoder.layers) - 1
    hooks = [(decoder if k == last else decoder.layers[k]).register_forward_hook(
        partial(record, k)) for k in layer_ids]
    try:
        yield outputs
    finally:
        for hook in hooks:
            hook.remove()


def layer_features(outputs: dict[int, torch.Tensor], layer_ids: list[int], row: int = 0
                   ) -> torch.Tensor:
    """[T, K*H]: the recorded features of layer_ids, of one row of a batch."""
    return torch.cat([outputs[k][row] for k in layer_ids], dim=-1)


class FeatureStore:
    """Features of the training sequences by index, in memory or in cache_dir."""

    def __init__(self, target_path: str, layer_ids: list[int], cache_dir: str | None) -> None:
        self.key = f"{Path(target_path).resolve()}|{layer_ids}"
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.memory: dict[int, torch.Tensor] = {}
        self.files: dict[int, Path] = {}
        if self.cache_dir:
            self.cache_dir.mkdir(parents=True, exist_ok=True)

    def _file(self, token_ids: list[int]) -> Path:
        digest = hashlib.sha1(f"{self.key}|{token_ids}".encode()).hexdigest()
        return self.cache_dir / f"{digest}.safetensors"

    def add(self, index: int, token_ids: list[int], compute) -> None:
        """Store the features of a sequence, calling compute() only on a cache miss."""
        if self.cache_dir is None:
            self.memory[index] = compute().cpu()
            return
        path = self._file(token_ids)
        if not path.exists():
            # Written aside, then renamed: a killed run or another rank never sees half a file.
            part = path.with_suffix(f".{os.getpid()}.part")
            save_file({"features": compute().cpu().contiguous()}, str(part))
            os.replace(part, path)
        self.files[index] = path

    def get(self, index: int) -> torch.Tensor:
        if self.cache_dir is None:
            return self.memory[index]
        return load_file(str(self.files[index]))["features"]
