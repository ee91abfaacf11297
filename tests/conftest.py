from collections.abc import Callable

import pytest

from vllm_dflash.config import DFlashConfig


@pytest.fixture
def make_config() -> Callable[..., DFlashConfig]:
    """Factory for a small drafter config; keyword arguments override fields."""

    def make(**overrides: object) -> DFlashConfig:
        num_layers = int(overrides.get("num_layers", 2))
        fields = {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_layers": num_layers,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 64,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 1024,
            "vocab_size": 512,
            "layer_types": ["full_attention"] * num_layers,
            "sliding_window": None,
            "block_size": 8,
            "mask_token_id": 1,
            "target_layer_ids": [2, 5],
            "num_target_layers": 8,
        }
        return DFlashConfig(**(fields | overrides))

    return make
