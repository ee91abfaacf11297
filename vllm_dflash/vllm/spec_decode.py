"""vLLM's V1 spec_decode subsystem: vllm-dflash's proposer for the V1 model runners (GPU and
CPU). The drafter's step itself is drafting.DraftRunner, shared with Model Runner V2.
Checked on vLLM 0.32.0 and 0.33.0.
"""

import logging
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from vllm_dflash.draft_sampling import draft_sampling
from vllm_dflash.kernels.draft_attention import DraftBatch, draft_attention_path
from vllm_dflash.vllm.config import (
    IMPL_ENV,
    DFlashSetupError,
    prompt_lookup_on,
    runs_vllm_dflash,
    validate_speculative_config,
)
from vllm_dflash.vllm.drafting import DraftRunner, target_layer_ids_for_vllm, warn_about_setup

logger = logging.getLogger("vllm.vllm_dflash")  # inherits vLLM's log handler


class PromptEmbedsAnchor:
    """A request as vLLM reads its fallback anchor: the last token before this step, for a
    request whose sampled token is discarded (a prefill chunk). A prompt given as embeddings
    has no token ids there and vLLM raises; the stand-in id replaces them. That anchor only
    starts drafts that are discarded: any other request anchors on the token it sampled."""

    def __init__(self, request: Any, stand_in: int) -> None:
        self.request, self.stand_in = request, stand_in

    def get_token_id(self, idx: int) -> int:
        if self.request.prompt_token_ids is None and idx < self.request.num_prompt_tokens:
            return self.stand_in
        return self.request.get_token_id(idx)


class DFlashProposer(SpecDecodeBaseProposer):
    """vllm-dflash's proposer; the V1 runner builds it for `method: "dflash"`."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner: Any = None) -> None:
        if not runs_vllm_dflash(vllm_config.speculative_config):
            raise DFlashSetupError(
                f"{IMPL_ENV}=vllm was set after vllm-dflash registered with vLLM in this "
                "process; set it before vLLM is imported (or in the environment of `vllm serve`)."
            )
        self.dflash_config = validate_speculative_config(vllm_config.speculative_config,
                                                        vllm_config.model_config)
        target_layer_ids_for_vllm(vllm_config, self.dflash_config)
        super().__init__(vllm_config, device, pass_hidden_states_to_model=True, runner=runner)
        spec = vllm_config.speculative_config
        # vLLM's base keeps draft probs only for "standard"; block verification reads them too.
        self._enable_probabilistic_draft_probs = (
            spec.draft_sample_method == "probabilistic"
            and spec.rejection_sample_method in ("standard", "block"))
        self.draft_runner = DraftRunner(vllm_config, self.dflash_config, device, self.dtype,
                                        self.max_batch_size)
        logger.info(
            "vllm-dflash: implementation=vllm-dflash (vllm_dflash.vllm.spec_decode.DFlashProposer), "
            "runner=%s (V1), drafter=%s, block_size=%d, num_speculative_tokens=%d, "
            "draft layers=%d, draft attention=%s, prompt lookup=%s",
            runner_name(runner),
            self.dflash_config.architecture,
            self.dflash_config.block_size,
            self.num_speculative_tokens,
            self.dflash_config.num_layers,
            draft_attention_path(self.device),
            "on" if prompt_lookup_on() else "off",
        )
        warn_about_setup(vllm_config, device)

    def _get_eagle3_use_aux_hidden_state_from_config(self) -> bool:
        return True  # the drafter always reads the target's intermediate features

    # ---- set-up -------------------------------------------------------------------------

    def load_model(self, target_model: torch.nn.Module) -> None:
        self.draft_runner.load(target_model)

    def initialize_attn_backend(
        self, kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int] | None = None
    ) -> None:
        self.kv_cache_gid = self.draft_runner.kv_cache_group(kv_cache_config)

    # ---- per step -----------------------------------------------------------------------

    def prepare_next_token_ids_padded(
        self, sampled_token_ids: torch.Tensor, requests: dict[str, Any], input_batch: Any,
        discard_request_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.vllm_config.model_config.enable_prompt_embeds:
            mask_id = self.dflash_config.mask_token_id
            requests = {req_id: PromptEmbedsAnchor(state, mask_id)
                        for req_id, state in requests.items()}
        return super().prepare_next_token_ids_padded(
            sampled_token_ids, requests, input_batch, discard_request_mask)

    @torch.inference_mode()
    def inject(self, target_hidden_states: torch.Tensor, target_token_ids: torch.Tensor,
               target_positions: torch.Tensor, common_attn_metadata: CommonAttentionMetadata
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """KV injection of the step's tokens, for a step that drafts; returns their context
        states and 1-D positions."""
        positions, slots = step_tokens(target_positions, common_attn_metadata)
        ctx = self.draft_runner.inject_context(target_hidden_states[:len(positions)],
                                               target_token_ids, positions, slots)
        return ctx, positions

    @torch.inference_mode()
    def queue_context(self, feature_chunks: list[torch.Tensor], target_token_ids: torch.Tensor,
                      target_positions: torch.Tensor,
                      common_attn_metadata: CommonAttentionMetadata) -> None:
        """A step that drafts nothing: its tokens' context waits for the next drafting step's
        injection. Alone, it is such a step (runner.py)."""
        positions, slots = step_tokens(target_positions, common_attn_metadata)
        self.draft_runner.queue_context([h[:len(positions)] for h in feature_chunks],
                                        target_token_ids, positions, slots)

    @torch.inference_mode()
    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: Any,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings: Any = None,
    ) -> torch.Tensor:
        cad = common_attn_metadata
        if num_speculative_tokens == 0:
            # The draft-length policy skips drafting this step; the context still grows.
            self.queue_context([target_hidden_states], target_token_ids, target_positions, cad)
            self._last_draft_probs = None
            return next_token_ids.new_empty(next_token_ids.shape[0], 0)
        ctx, target_positions = self.inject(target_hidden_states, target_token_ids,
                                            target_positions, cad)
        context_lens = cad.seq_lens
        last_valid = cad.query_start_loc[1:] - 1  # each request's last accepted token
        if num_rejected_tokens_gpu is not None:
            context_lens = context_lens - num_rejected_tokens_gpu
            last_valid = last_valid - num_rejected_tokens_gpu
        batch = DraftBatch(
            block_table=cad.block_table_tensor,
            context_lens=context_lens.to(torch.int32),
            query_start_loc=self.draft_runner.block_starts[: cad.batch_size() + 1],
            # The anchor follows the last accepted token: its index for text, behind it under
            # M-RoPE after an image.
            anchor_positions=(target_positions[last_valid.long()] + 1).to(torch.int32),
        )
        sampling = (draft_sampling(sampling_metadata, batch.context_lens.shape[0])
                    if self._enable_probabilistic_draft_probs else None)
        # LiLiCorr's head reads the context state of each request's last accepted token.
        anchor_states = (ctx[last_valid.long()] if self.draft_runner.drafter.lilicorr is not None
                         else None)
        tokens = self.draft_runner.draft_tokens(next_token_ids, batch, num_speculative_tokens,
                                                sampling, anchor_states)
        self._last_draft_probs = self.draft_runner.last_draft_probs
        return tokens

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True,
                  is_graph_capturing: bool = False, slot_mappings: Any = None) -> None:
        """Profile-time run at the largest shapes; writes no cache (pages may not exist yet).
        The first run while vLLM captures its CUDA graphs captures the drafter's."""
        if (is_graph_capturing and self.draft_runner.draft_graphs is None
                and self.draft_runner.uses_cuda_graphs()
                and not torch.cuda.is_current_stream_capturing()):
            self.draft_runner.capture_draft_graphs()
        self.draft_runner.dummy_run(num_tokens, sampling=self._enable_probabilistic_draft_probs)


def step_tokens(positions: torch.Tensor, common_attn_metadata: CommonAttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's tokens' 1-D positions [T] and cache slots [T]. M-RoPE targets (Qwen3-VL,
    Qwen3.5) give positions [sections, T]; a text token has the same position in every
    section. The drafter's RoPE is 1-D: the first section, as for vLLM's drafters."""
    if positions.dim() == 2:
        positions = positions[0]
    return positions, common_attn_metadata.slot_mapping[:positions.shape[0]]


SUPPORTED_RUNNERS = ("GPUModelRunner (V1)", "CPUModelRunner")


def runner_name(runner: object) -> str:
    name = type(runner).__name__
    if name not in ("GPUModelRunner", "CPUModelRunner"):
        raise DFlashSetupError(
            f"vllm-dflash does not support the model runner {name}; supported: "
            f"{', '.join(SUPPORTED_RUNNERS)}. Set {IMPL_ENV}=vllm for vLLM's in-tree DFlash."
        )
    return name
