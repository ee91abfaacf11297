"""vLLM's attention subsystem, as the drafter uses it: its context KV cache declared to vLLM.

The drafter's KV cache pages are owned by vLLM's KV cache manager through `DraftKVLayer`s
registered in the forward context, so they are allocated, freed, preempted and prefix-cached
with the request like any attention layer's; vllm-dflash's kernels read and write them.
Checked on vLLM 0.32.0 and 0.33.0, V1 runner and Model Runner V2.
"""

from typing import ClassVar

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImplBase,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec


class DraftKVLayer(torch.nn.Module, AttentionLayerBase):
    """Declares one draft layer's context KV cache to vLLM; vLLM binds `kv_cache` to it.

    Its logical shape is vLLM's `[num_blocks, num_kv_heads, block_size, 2 * head_dim]`
    (K then V on the last dim), which every vllm-dflash kernel reads and writes.
    """

    is_draft_layer = True

    def __init__(
        self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.head_size = head_dim
        self.dtype = dtype
        # One zero block until vLLM binds the real cache: profile runs (dummy_run, before the
        # KV cache exists) go through the same kernels with empty contexts.
        self.kv_cache = torch.zeros(1, num_kv_heads, 1, 2 * head_dim, dtype=dtype, device=device)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return DraftKVBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
        )


class DraftKVMetadataBuilder(AttentionMetadataBuilder[None]):
    """The draft layers take their metadata from the proposer, not from the target's step."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> None:
        return None


class DraftKVBackend(AttentionBackend):
    """A KV-cache-only backend: vLLM allocates and binds pages, vllm-dflash kernels use them."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "VLLM_DFLASH_DRAFT_KV"

    @staticmethod
    def get_impl_cls() -> type[AttentionImplBase]:
        raise NotImplementedError("draft layers run vllm-dflash's draft attention kernel")

    @staticmethod
    def get_builder_cls() -> type[DraftKVMetadataBuilder]:
        return DraftKVMetadataBuilder
