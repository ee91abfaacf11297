"""DFlashDrafter vs the reference dflash==0.1.0 DFlashDraftModel on one random checkpoint (fp32)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dflash.model import DFlashDraftModel, _attention_mask, _crop_to, _make_cache
from dflash.model import _raw_input_embeddings as reference_embed
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config

from vllm_dflash.checkpoint import load_drafter, save_drafter
from vllm_dflash.config import DFlashConfig, default_target_layer_ids
from vllm_dflash.layers import apply_rope, rms_norm
from vllm_dflash.model import KV, DFlashDrafter, block_mask, dense_attend
from vllm_dflash.tiny import random_drafter

TOL = {"atol": 1e-4, "rtol": 0.0}
EXACT = {"atol": 1e-5, "rtol": 0.0}  # same math, only the float summation order differs
NUM_TARGET_LAYERS = 8


class Target(SimpleNamespace):
    """Stands in for the target model: the reference only needs its embedding and lm_head."""

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens


def make_target(cfg: DFlashConfig) -> Target:
    generator = torch.Generator().manual_seed(1)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator) * 0.1
    return Target(embed_tokens=nn.Embedding.from_pretrained(embed), lm_head_weight=lm_head)


def parity_config(make_config, block_size: int, num_features: int, gqa: int, **overrides):
    return make_config(
        block_size=block_size,
        num_kv_heads=4 // gqa,
        target_layer_ids=default_target_layer_ids(NUM_TARGET_LAYERS, num_features),
        num_target_layers=NUM_TARGET_LAYERS,
        **overrides,
    )


def build(cfg: DFlashConfig, path: Path) -> tuple[DFlashDrafter, DFlashDraftModel]:
    """Save one random checkpoint; load it with load_drafter and into the reference model."""
    drafter = random_drafter(cfg, seed=0)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # non-unit norm weights, so a swapped norm cannot go unnoticed
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    save_drafter(drafter, path)
    reference = DFlashDraftModel(Qwen3Config.from_pretrained(path))
    reference.load_state_dict(load_file(path / "model.safetensors"))
    return load_drafter(path).eval(), reference.eval()


def block_tokens(cfg: DFlashConfig, seed: int) -> torch.Tensor:
    anchor = torch.randint(2, cfg.vocab_size, (1,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([anchor, torch.full((cfg.block_size - 1,), cfg.mask_token_id)])


def layer_masks(cfg: DFlashConfig, context_len: int) -> list[torch.Tensor]:
    return [
        block_mask(context_len, cfg.block_size, cfg.layer_is_causal(i), cfg.layer_window(i))
        for i in range(cfg.num_layers)
    ]


def draft(
    drafter: DFlashDrafter, context: list[KV], tokens: torch.Tensor, target: Target
) -> torch.Tensor:
    """Our draft hidden states for a block that follows the len(context) tokens of context."""
    start = context[0][0].shape[0]
    attend = dense_attend(context, layer_masks(drafter.cfg, start), drafter.scale)
    positions = torch.arange(start, start + len(tokens))
    return drafter(drafter.embed(tokens, target.embed_tokens.weight), positions, attend,
                   block_len=len(tokens))


def reference_draft(
    reference: DFlashDraftModel,
    features: torch.Tensor,
    start: int,
    tokens: torch.Tensor,
    target: Target,
    cache=None,
) -> torch.Tensor:
    """The reference's draft call, as in its dflash_generate: new features + block, one cache."""
    scale = reference.config.dflash_config["input_embedding_scale"]
    positions = torch.arange(start - len(features), start + len(tokens))
    return reference(
        position_ids=positions[None],
        noise_embedding=reference_embed(target, tokens[None], scale),
        target_hidden=features[None],
        past_key_values=cache,
        use_cache=cache is not None,
    )[0]


def features(cfg: DFlashConfig, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(length, cfg.num_features * cfg.hidden_size, generator=generator)


def context_of(drafter: DFlashDrafter, feats: torch.Tensor, start: int = 0) -> list[KV]:
    return drafter.context_kv(drafter.fuse(feats), torch.arange(start, start + len(feats)))


SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}
SCALED = {"output_multiplier": 0.5, "final_logit_softcapping": 3.0, "input_embedding_scale": 2.0}
PARITY_CASES = [
    # block_size, num_features, gqa (query heads per KV head), context_len, config overrides
    pytest.param(4, 1, 1, 1, {}, id="b4-f1-gqa1-c1"),
    pytest.param(8, 5, 4, 37, {}, id="b8-f5-gqa4-c37"),
    pytest.param(16, 5, 1, 300, {}, id="b16-f5-gqa1-c300"),
    pytest.param(16, 1, 4, 37, {}, id="b16-f1-gqa4-c37"),
    pytest.param(8, 1, 1, 300, {}, id="b8-f1-gqa1-c300"),
    pytest.param(4, 5, 4, 300, {}, id="b4-f5-gqa4-c300"),
    pytest.param(8, 5, 4, 37, SLIDING, id="sliding"),
    pytest.param(8, 1, 1, 37, {"causal": True}, id="causal"),
    pytest.param(8, 5, 1, 37, SCALED, id="scaled-logits"),
]


@pytest.mark.parametrize("block_size, num_features, gqa, context_len, overrides", PARITY_CASES)
@torch.inference_mode()
def test_draft_matches_reference(
    block_size: int,
    num_features: int,
    gqa: int,
    context_len: int,
    overrides: dict,
    make_config,
    tmp_path: Path,
) -> None:
    cfg = parity_config(make_config, block_size, num_features, gqa, **overrides)
    drafter, reference = build(cfg, tmp_path)
    target = make_target(cfg)
    feats, tokens = features(cfg, context_len), block_tokens(cfg, seed=0)

    hidden = draft(drafter, context_of(drafter, feats), tokens, target)
    expected = reference_draft(reference, feats, context_len, tokens, target)
    torch.testing.assert_close(hidden, expected, **TOL)

    head = target.lm_head_weight
    logits = drafter.logits(hidden, head)
    torch.testing.assert_close(
        logits, reference.compute_logits(expected, lambda h: h @ head.T), **TOL
    )
    assert logits.std() > 0.1  # random weights still give informative logits


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@torch.inference_mode()
def test_incremental_context_cache(sliding: bool, make_config, tmp_path: Path) -> None:
    """Context K/V appended per accepted token == recomputed from scratch == reference cache."""
    cfg = parity_config(make_config, 8, 5, 4, **(SLIDING if sliding else {}))
    drafter, reference = build(cfg, tmp_path)
    target = make_target(cfg)
    accepted_per_step = [3, 0, 7, 1, 5]
    start = 37
    feats = features(cfg, start + sum(a + 1 for a in accepted_per_step))
    cached = context_of(drafter, feats[:start])
    reference_cache = _make_cache(reference.config)
    new_feats = feats[:start]

    for step, accepted in enumerate(accepted_per_step):
        tokens = block_tokens(cfg, seed=step)
        scratch = context_of(drafter, feats[:start])
        for (k, v), (k_scratch, v_scratch) in zip(cached, scratch):
            torch.testing.assert_close(k, k_scratch, **EXACT)
            torch.testing.assert_close(v, v_scratch, **EXACT)
        hidden = draft(drafter, cached, tokens, target)
        torch.testing.assert_close(hidden, draft(drafter, scratch, tokens, target), **EXACT)
        expected = reference_draft(reference, new_feats, start, tokens, target, reference_cache)
        _crop_to(reference_cache, start)  # the reference drops the block's K/V, as we do
        torch.testing.assert_close(hidden, expected, **TOL)
        for i, ((k, v), layer) in enumerate(zip(cached, reference_cache.layers)):
            # The reference keeps only the last window-1 tokens of a sliding layer.
            kept = layer.keys.shape[2]
            assert kept == (start if cfg.layer_window(i) is None else cfg.sliding_window - 1)
            torch.testing.assert_close(k[-kept:], layer.keys[0].transpose(0, 1), **TOL)
            torch.testing.assert_close(v[-kept:], layer.values[0].transpose(0, 1), **TOL)

        # Only the accepted tokens plus the bonus extend the context.
        new_feats = feats[start : start + accepted + 1]
        step_kv = context_of(drafter, new_feats, start)
        cached = [
            (torch.cat([k, nk]), torch.cat([v, nv])) for (k, v), (nk, nv) in zip(cached, step_kv)
        ]
        start += accepted + 1


@torch.inference_mode()
def test_kv_weight_gives_context_kv(make_config) -> None:
    """The kernel-facing weights reproduce context_kv: x @ kv_weight.T, k_norm, RoPE."""
    cfg = make_config(num_layers=3)
    drafter = random_drafter(cfg, seed=0)
    ctx = torch.randn(11, cfg.hidden_size)
    positions = torch.arange(5, 16)
    kv = (ctx @ drafter.kv_weight().T).view(11, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    k_norm = drafter.k_norm_weight()
    cos_sin = drafter.rope_cache(ctx.device)
    for i, (k, v) in enumerate(drafter.context_kv(ctx, positions)):
        k_expected = apply_rope(
            rms_norm(kv[:, i, 0], k_norm[i], cfg.rms_norm_eps), positions, cos_sin
        )
        torch.testing.assert_close(k, k_expected, **EXACT)
        torch.testing.assert_close(v, kv[:, i, 1], **EXACT)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_block_mask_matches_reference(causal: bool, window: int | None) -> None:
    context_len, block_len = 13, 8
    q = torch.empty(block_len, 1)
    k = torch.empty(context_len + block_len, 1)
    expected = _attention_mask(q, k, is_causal=causal, sliding_window=window)[0, 0]
    assert torch.equal(block_mask(context_len, block_len, causal, window), expected)


def test_dense_attend_shared_mask_is_plain_attention() -> None:
    """One mask for all layers, all visible: SDPA over [context; block] with GQA repeat."""
    q, k, v = torch.randn(4, 4, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    context = [(torch.randn(3, 2, 8), torch.randn(3, 2, 8))] * 2
    attend = dense_attend(context, torch.ones(4, 7, dtype=torch.bool), scale=0.5)
    keys = torch.cat([context[1][0], k]).repeat_interleave(2, dim=1)
    values = torch.cat([context[1][1], v]).repeat_interleave(2, dim=1)
    weights = F.softmax(torch.einsum("qhd,khd->hqk", q, keys) * 0.5, dim=-1)
    torch.testing.assert_close(attend(1, q, k, v), torch.einsum("hqk,khd->qhd", weights, values))


def test_rope_cache_grows_past_the_trained_positions(make_config) -> None:
    # Blocks near max_model_len draft past max_position_embeddings (their drafts are never
    # verified); the table grows and keeps its trained rows.
    drafter = random_drafter(make_config(max_position_embeddings=64))
    cpu = torch.device("cpu")
    trained = drafter.rope_cache(cpu).clone()
    assert trained.shape[0] == 64
    grown = drafter.rope_cache(cpu, min_positions=80)
    assert grown.shape[0] == 80
    torch.testing.assert_close(grown[:64], trained, **EXACT)
    assert drafter.rope_cache(cpu) is grown  # later calls without a minimum keep it
