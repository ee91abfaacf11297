"""vLLM's Model Runner V2 (`vllm/v1/worker/gpu/spec_decode/`): vllm-dflash's speculator.

MRV2 builds its speculator through `init_speculator`, then calls load_model, set_attn,
init_cudagraph_manager and, every step after sampling, propose. The drafter's step is
drafting.DraftRunner, the same as on the V1 runner; verification is MRV2's own rejection
sampler (argmax-prefix acceptance for greedy requests, the standard rule for sampling ones:
both lossless). With `draft_sample_method: "probabilistic"` a DFlash drafter's drafts are drawn
by MRV2's own draft sampler (gumbel_sample at each request's temperature, keyed by its seed and
position), which leaves the drafter's logits in draft_logits for the rejection sampler's q;
otherwise, and for DFlash2 and LiLiCorr drafters (whose drafts are their selector's walk, not
draws from the logits), drafts are the greedy ones, one-hot q. This module imports MRV2 and is imported only when MRV2
builds a speculator: on the CPU build MRV2's modules must load after vLLM's CPU worker
patches torch. Checked on vLLM 0.32.0 (run, CPU) and 0.33.0 (read).
"""

import logging
from typing import Any

import torch
from torch import nn
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

from vllm_dflash.kernels.draft_attention import DraftBatch, draft_attention_path
from vllm_dflash.vllm.config import prompt_lookup_on, validate_speculative_config
from vllm_dflash.vllm.drafting import DraftRunner, target_layer_ids_for_vllm, warn_about_setup

logger = logging.getLogger("vllm.vllm_dflash")  # inherits vLLM's log handler
# A prompt-lookup draft's cached logit for every other token: q = 0 there at any temperature
# MRV2 divides it by, with no overflow to -inf.
LOOKUP_OFF_LOGIT = -1e4


class DFlashSpeculator(DraftModelSpeculator):
    """vllm-dflash's speculator for Model Runner V2 (MRV2 verifies its drafts)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.dflash_config = validate_speculative_config(vllm_config.speculative_config,
                                                        vllm_config.model_config)
        target_layer_ids_for_vllm(vllm_config, self.dflash_config)
        super().__init__(vllm_config, device)
        self.draft_runner = DraftRunner(vllm_config, self.dflash_config, device, self.dtype,
                                        self.max_num_reqs)
        probabilistic = vllm_config.speculative_config.draft_sample_method == "probabilistic"
        if probabilistic and self.dflash_config.has_selector:
            # One-hot drafts: MRV2's rejection sampler then verifies sampling requests by the
            # standard rule with q one-hot, which keeps the target's distribution.
            self.draft_logits = None
            logger.warning("vllm-dflash: draft_sample_method='probabilistic' is not supported "
                           "for %s drafters on Model Runner V2 yet: drafts are greedy "
                           "(verification stays exact); VLLM_USE_V2_MODEL_RUNNER=0 samples "
                           "them on the V1 runner", self.dflash_config.architecture)
        logger.info(
            "vllm-dflash: implementation=vllm-dflash (vllm_dflash.vllm.speculator."
            "DFlashSpeculator), runner=Model Runner V2, drafter=%s, block_size=%d, "
            "num_speculative_tokens=%d, draft layers=%d, draft attention=%s, prompt lookup=%s",
            self.dflash_config.architecture, self.dflash_config.block_size,
            self.num_speculative_steps, self.dflash_config.num_layers,
            draft_attention_path(device), "on" if prompt_lookup_on() else "off")
        warn_about_setup(vllm_config, device)

    # ---- set-up -------------------------------------------------------------------------

    def load_draft_model(self, target_model: nn.Module,
                         target_attn_layer_names: set[str]) -> nn.Module:
        # The draft KV layers join vLLM's forward context here: MRV2 takes every attention
        # layer the target does not own as the drafter's (draft_attn_layer_names).
        self.draft_runner.load(target_model)
        return self.draft_runner.drafter

    def set_attn(self, model_state: Any, kv_cache_config: Any, block_tables: Any,
                 target_input_buffers: Any, target_attn_groups: Any) -> None:
        super().set_attn(model_state, kv_cache_config, block_tables, target_input_buffers,
                         target_attn_groups)
        # The draft layers share the target's KV cache group: its block table and slots.
        self.kv_cache_gid = self.draft_runner.kv_cache_group(kv_cache_config)

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        pass  # the drafter's CUDA graphs are its own (draft_graphs.py), captured in capture()

    def capture(self) -> None:
        if self.draft_runner.draft_graphs is None and self.draft_runner.uses_cuda_graphs():
            self.draft_runner.capture_draft_graphs()

    # ---- per step -----------------------------------------------------------------------

    @torch.inference_mode()
    def propose(
        self,
        input_batch: Any,
        attn_metadata: dict[str, Any] | None,
        slot_mappings: dict[str, torch.Tensor] | None,
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        dp_sync_state: Any = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: Any = None,
        is_profile: bool = False,
        num_speculative_tokens: int | None = None,
    ) -> torch.Tensor:
        """[num_reqs, K] int64 draft tokens (the first k real, -1 after), the runner's shape
        whatever k this step drafts; k = 0 still queues the step's context for injection."""
        num_reqs, max_draft = input_batch.num_reqs, self.num_speculative_steps
        num_draft = max_draft if num_speculative_tokens is None else num_speculative_tokens
        drafts = torch.full((num_reqs, max_draft), -1, dtype=torch.int64, device=self.device)
        if dummy_run:  # profiling, possibly before the KV cache exists: writes no cache
            self.draft_runner.dummy_run(input_batch.num_tokens, sampling=False)
            return drafts
        num_tokens = input_batch.num_tokens
        positions = input_batch.positions[:num_tokens]
        features = [h[:num_tokens] for h in aux_hidden_states]
        slots = slot_mappings[self.draft_runner.kv_layer_names[0]][:num_tokens]
        token_ids = input_batch.input_ids[:num_tokens]
        if num_draft == 0:  # the context waits for the next drafting step's injection
            self.draft_runner.queue_context(features, token_ids, positions, slots)
            return drafts
        ctx = self.draft_runner.inject_context(torch.cat(features, dim=-1), token_ids, positions,
                                               slots)
        rejected = num_rejected[:num_reqs]
        last_valid = (input_batch.query_start_loc[1:num_reqs + 1] - 1 - rejected).long()
        rows = input_batch.idx_mapping[:num_reqs]
        # A prefill chunk samples nothing; its drafts are never verified, anchored on the
        # prompt's next token.
        anchors = torch.where(num_sampled[:num_reqs] > 0, last_sampled[rows, 0],
                              next_prefill_tokens[0, rows].long()).to(torch.int32)
        batch = DraftBatch(
            block_table=self.block_tables.input_block_tables[self.kv_cache_gid][:num_reqs],
            context_lens=(input_batch.seq_lens[:num_reqs] - rejected).to(torch.int32),
            query_start_loc=self.draft_runner.block_starts[:num_reqs + 1],
            anchor_positions=(positions[last_valid] + 1).to(torch.int32),
        )
        if self.draft_logits is not None:
            drafts[:, :num_draft] = self.sampled_drafts(anchors, batch, num_draft, rows,
                                                        temperature, seeds)
            return drafts
        anchor_states = (ctx[last_valid] if self.draft_runner.drafter.lilicorr is not None
                         else None)
        drafts[:, :num_draft] = self.draft_runner.draft_tokens(anchors, batch, num_draft, None,
                                                               anchor_states)
        return drafts

    def sampled_drafts(self, anchors: torch.Tensor, batch: DraftBatch, num_draft: int,
                       rows: torch.Tensor, temperature: torch.Tensor,
                       seeds: torch.Tensor) -> torch.Tensor:
        """[num_reqs, num_draft] drafts drawn by MRV2's draft sampler, which caches the
        drafter's logits in draft_logits[row, j] for verification. Draft j predicts position
        anchor + 1 + j; MRV2 keys its draw by the position before, anchor + j."""
        num_reqs = anchors.shape[0]
        hidden = self.draft_runner.block_hidden(anchors, batch)[:, :num_draft].flatten(0, 1)
        steps = torch.arange(num_draft, device=self.device)
        positions = (batch.anchor_positions[:, None].long() + steps).flatten()
        tokens = self.sample_draft(hidden, positions, rows.long().repeat_interleave(num_draft),
                                   temperature, seeds, steps.repeat(num_reqs).to(torch.int32),
                                   self.draft_logits).view(num_reqs, num_draft)
        lookup = self.draft_runner.lookup(anchors, batch, num_draft)
        return tokens if lookup is None else self.with_lookup_logits(tokens, rows, *lookup)

    def with_lookup_logits(self, tokens: torch.Tensor, rows: torch.Tensor,
                           lookup_tokens: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
        """The drawn drafts [B, k] with the rows `found` replaced by prompt lookup's, whose
        cached draft logits become one-hot (q = 1 at the draft: exact verification of a
        deterministic draft). Finite: MRV2 divides them by the temperature and sums exp() over
        vocabulary blocks, which an all -inf block would turn into NaN."""
        tokens = torch.where(found[:, None], lookup_tokens, tokens)
        rows = rows.long()
        cached = self.draft_logits[rows, :tokens.shape[1]]
        one_hot = torch.full_like(cached, LOOKUP_OFF_LOGIT).scatter_(-1, tokens[..., None], 0.0)
        self.draft_logits[rows, :tokens.shape[1]] = torch.where(found[:, None, None], one_hot,
                                                                 cached)
        return tokens

    def compute_draft_logits(self, hidden_states: torch.Tensor,
                             spec_step_idx: int) -> torch.Tensor:
        logits = self.draft_runner.logits(hidden_states)
        # MRV2 caches them in draft_logits (the target's head dtype); a bf16 draft head's
        # (VLLM_DFLASH_DRAFT_HEAD) are cast to it.
        return logits if self.draft_logits is None else logits.to(self.draft_logits.dtype)
