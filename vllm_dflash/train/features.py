"""The target model (HF transformers) and its hidden states at the drafter's layers.

Feature id k is the output of decoder layer k, i.e. `output_hidden_states[k + 1]`. Features of
each training sequence are computed once and kept in memory, or in a disk cache keyed by the
target, the layer ids and the token ids; or, online, computed for each batch as it trains.
"""

import hashlib
import os
from pathlib import Path

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
    out = model(input_ids=ids, output_hidden_states=True)
    return layer_features(out.hidden_states, layer_ids), out.logits[0]


@torch.no_grad()
def context_features(
    model: PreTrainedModel, token_ids: list[int], layer_ids: list[int]
) -> torch.Tensor:
    """Features [T, K*H] of the layers layer_ids, from the decoder alone: training needs no
    target logits, and the lm_head is a fifth of a small target's forward pass."""
    ids = torch.tensor([token_ids], device=model.device)
    out = model.get_decoder()(input_ids=ids, output_hidden_states=True)
    return layer_features(out.hidden_states, layer_ids)


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
    out = model.get_decoder()(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                              output_hidden_states=True)
    return [layer_features(out.hidden_states, layer_ids, row)[:n] for row, n in enumerate(lengths)]


def layer_features(
    hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int], row: int = 0
) -> torch.Tensor:
    """[T, K*H]: the outputs of decoder layers layer_ids of one row of a batch."""
    return torch.cat([hidden_states[k + 1][row] for k in layer_ids], dim=-1)


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
