"""DFlash2 drafters (`DFlash2DraftModel`: grouped dynamic causal convolutions in every layer and
a candidate selector): config, the drafter and the selector's walk against the reference
dflash==0.1.0, sampled drafts' distributions, and real engines (greedy output equals no
speculation, seeded sampling reproducible)."""

from pathlib import Path

import pytest
import torch
from dflash.model import DFlash2DraftModel
from safetensors.torch import load_file
from transformers import Qwen3Config

from tests.chi_square import assert_distribution
from tests.engines import (
    Pair,
    assert_lossless_and_reproducible,
    dflash_llm,
    greedy_baseline,
    prompts_of_lengths,
)
from tests.test_model_parity import (
    NUM_TARGET_LAYERS,
    TOL,
    block_tokens,
    context_of,
    draft,
    features,
    make_target,
    reference_draft,
)
from vllm_dflash.checkpoint import load_drafter, save_drafter
from vllm_dflash.config import (
    DFLASH2_KEYS,
    DFlashConfig,
    DFlashConfigError,
    default_target_layer_ids,
)
from vllm_dflash.draft_sampling import DraftSampling, select_drafts
from vllm_dflash.model import SelectorInputs, walk
from vllm_dflash.tiny import random_drafter

DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 32, "selector_rank": 16,
           "selector_top_k": 8}


def dflash2_config(make_config, **overrides) -> DFlashConfig:
    fields = {"num_kv_heads": 1, "num_target_layers": NUM_TARGET_LAYERS,
              "target_layer_ids": default_target_layer_ids(NUM_TARGET_LAYERS, 3)}
    return make_config(**(fields | DFLASH2 | overrides))


def build(cfg: DFlashConfig, path: Path):
    """One random DFlash2 checkpoint, loaded by load_drafter and into the reference model."""
    save_drafter(random_drafter(cfg, seed=0), path)
    reference = DFlash2DraftModel(Qwen3Config.from_pretrained(path))
    state = load_file(path / "model.safetensors")
    # The checkpoints' codebook keys carry no ".weight"; the reference maps them on loading.
    state = {f"{key}.weight" if key.endswith("codebook") else key: value
             for key, value in state.items()}
    reference.load_state_dict(state)
    return load_drafter(path).eval(), reference.eval()


# ---------------------------------------------------------------------------- config


def test_config_round_trip_and_architecture(make_config) -> None:
    cfg = dflash2_config(make_config)
    d = cfg.to_dict()
    assert d["architectures"] == ["DFlash2DraftModel"]
    assert {key: d["dflash_config"][key] for key in DFLASH2_KEYS} == DFLASH2
    assert DFlashConfig.from_dict(d) == cfg
    assert make_config().to_dict()["architectures"] == ["DFlashDraftModel"]


@pytest.mark.parametrize("change, message", [
    ({"conv_group_size": 48}, "conv_group_size 48 does not divide hidden_size 128"),
    ({"selector_top_k": 0}, "selector_top_k 0 is outside"),
    ({"selector_top_k": 513}, "selector_top_k 513 is outside"),
    ({"selector_rank": None}, "['selector_rank'] missing"),
    ({key: None for key in DFLASH2}, "none of"),
])
def test_config_errors_name_the_key(make_config, change: dict, message: str) -> None:
    d = dflash2_config(make_config).to_dict()
    d["dflash_config"] |= change
    with pytest.raises(DFlashConfigError, match="fix:") as err:
        DFlashConfig.from_dict(d)
    assert message in str(err.value)


# ---------------------------------------------------------------------------- drafter


@pytest.mark.parametrize("block_size, taps, context_len", [(4, 1, 1), (8, 3, 37), (16, 4, 300),
                                                          (4, 6, 20)])
@torch.inference_mode()
def test_drafter_and_greedy_walk_match_reference(block_size: int, taps: int, context_len: int,
                                                 make_config, tmp_path: Path) -> None:
    cfg = dflash2_config(make_config, block_size=block_size,
                         conv_kernel_size=min(taps, block_size))
    drafter, reference = build(cfg, tmp_path)
    target = make_target(cfg)
    feats = features(cfg, context_len)
    head = target.lm_head_weight
    differs = 0
    for seed in range(4):
        tokens = block_tokens(cfg, seed)
        hidden = draft(drafter, context_of(drafter, feats), tokens, target)
        expected = reference_draft(reference, feats, context_len, tokens, target)
        torch.testing.assert_close(hidden, expected, **TOL)

        h = hidden[None, 1:]
        logits = drafter.logits(h, head)
        drafts, _ = select_drafts(drafter.candidate_selector, h, logits, SelectorInputs(tokens[:1]), None)
        want, _, _ = reference.propose(expected[None, 1:], tokens[:1], lambda x: x @ head.T, 0.0)
        assert torch.equal(drafts, want)
        differs += int((drafts != logits.argmax(dim=-1)).any())
    assert differs  # the selector's edges overrule the logits' order somewhere


def test_drafter_without_block_len_says_so(make_config) -> None:
    drafter = random_drafter(dflash2_config(make_config))
    with pytest.raises(ValueError, match="needs block_len"):
        drafter(torch.zeros(8, 128), torch.arange(8), lambda i, q, k, v: q)


# ---------------------------------------------------------------------------- sampled drafts


def selector_inputs(make_config, num_reqs: int = 4, k: int = 5):
    cfg = dflash2_config(make_config)
    drafter = random_drafter(cfg, seed=1)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_reqs, k, cfg.hidden_size, generator=gen)
    logits = 2 * torch.randn(num_reqs, k, cfg.vocab_size, generator=gen)
    anchors = torch.randint(2, cfg.vocab_size, (num_reqs,), generator=gen)
    return drafter.candidate_selector, hidden, logits, SelectorInputs(anchors)


@torch.inference_mode()
def test_sampled_drafts_carry_their_walks_distribution(make_config) -> None:
    """q at each position is softmax(edge scores from the token taken before / T) over the
    candidates, zero elsewhere; greedy rows take the greedy walk with one-hot q."""
    torch.manual_seed(0)  # the draws
    selector, hidden, logits, anchors = selector_inputs(make_config)
    temperature = torch.tensor([0.7, 1.0, 1.5, 1.0])
    sampled = torch.tensor([True, True, True, False])
    tokens, probs = select_drafts(selector, hidden, logits, anchors,
                                  DraftSampling(temperature, sampled))
    candidates, scores = selector.edge_scores(hidden, logits, anchors)
    greedy = walk(candidates, scores.argmax(dim=-1))[0]
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(tokens.shape))
    for b in range(4):
        if not sampled[b]:
            assert torch.equal(tokens[b], greedy[b])
            assert torch.equal(probs[b].argmax(dim=-1), tokens[b]) and probs[b].max() == 1
            continue
        previous = 0
        for p in range(tokens.shape[1]):
            q = (scores[b, p, previous] / temperature[b]).softmax(dim=-1)
            torch.testing.assert_close(probs[b, p, candidates[b, p]], q)
            assert probs[b, p].count_nonzero() == (q > 0).sum()
            previous = int((candidates[b, p] == tokens[b, p]).nonzero())


@torch.inference_mode()
def test_sampled_first_draft_follows_q(make_config) -> None:
    """The first position's draws over 4000 walks match its q (chi-square)."""
    torch.manual_seed(0)  # the draws
    selector, hidden, logits, anchors = selector_inputs(make_config, num_reqs=1)
    sampling = DraftSampling(torch.tensor([1.0]), torch.tensor([True]))
    _, probs = select_drafts(selector, hidden, logits, anchors, sampling)
    draws = torch.stack([select_drafts(selector, hidden, logits, anchors, sampling)[0][0, 0]
                         for _ in range(4000)])
    assert_distribution(draws, probs[0, 0])


# ---------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    from vllm_dflash.tiny import write_random_drafter, write_random_target

    root = tmp_path_factory.mktemp("dflash2")
    target = write_random_target(root / "target")
    dflash2 = DFLASH2 | {"conv_group_size": 16}
    write_random_drafter(root / "drafter", target, block_size=8, head=dflash2)
    return Pair(target=target, drafter=root / "drafter", block_size=8)


@pytest.fixture(scope="module")
def prompts(pair) -> list[dict]:
    return prompts_of_lengths(pair.target, (1, 9, 57, 200))


@pytest.fixture(scope="module")
def baseline(pair, prompts) -> list[list[int]]:
    return greedy_baseline(pair.target, prompts, max_tokens=40, max_num_seqs=4)


@pytest.mark.parametrize("speculative", [{}, {"draft_sample_method": "probabilistic"}],
                         ids=["greedy-drafts", "probabilistic-drafts"])
def test_engine_is_lossless_and_reproducible(pair, prompts, baseline, speculative: dict,
                                             monkeypatch) -> None:
    import vllm_dflash.draft_sampling

    # Fixed K: a random drafter would have the adaptive policy switch drafting off.
    monkeypatch.setenv("VLLM_DFLASH_DRAFT_LENGTH", "fixed")
    walks = {"greedy": 0, "sampled": 0}  # the engine runs in this process (tests' default)
    select = vllm_dflash.draft_sampling.select_drafts

    def counted_select(selector, hidden, logits, anchors, sampling):
        walks["greedy" if sampling is None or not sampling.sampled.any() else "sampled"] += 1
        return select(selector, hidden, logits, anchors, sampling)

    monkeypatch.setattr(vllm_dflash.draft_sampling, "select_drafts", counted_select)
    llm = dflash_llm(pair, num_speculative_tokens=5, speculative=speculative, max_num_seqs=4)
    assert_lossless_and_reproducible(llm, prompts, baseline, max_tokens=40,
                                     num_speculative_tokens=5)
    assert walks["greedy"] > 0
    assert (walks["sampled"] > 0) == bool(speculative)
