"""LiLiCorr drafters (`LiLiCorrDraftModel`: a DFlash drafter whose drafts a candidate-lattice
head chooses): config, the head against vLLM 0.32's own LiLiCorrHead, checkpoints, and real
engines (greedy output equals no speculation, seeded sampling reproducible)."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.engines import (
    Pair,
    assert_lossless_and_reproducible,
    dflash_llm,
    greedy_baseline,
    prompts_of_lengths,
)
from vllm_dflash.checkpoint import load_drafter, save_drafter
from vllm_dflash.config import DFlashConfig, DFlashConfigError, LiLiCorrConfig
from vllm_dflash.model import SelectorInputs, walk
from vllm_dflash.tiny import random_drafter

REPO = Path(__file__).resolve().parents[1]
LILICORR = LiLiCorrConfig(candidate_topk=4, hidden_size=64, num_layers=2, num_heads=4,
                          mlp_ratio=2.0, factor_dim=16, vector_eps=1e-6, logit_scale=10.0)


def lilicorr_config(make_config, **overrides) -> DFlashConfig:
    return make_config(**({"lilicorr": LILICORR} | overrides))


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize("convolutions", [{}, {"conv_kernel_size": 3, "conv_group_size": 32}],
                         ids=["plain", "convolutions"])
def test_config_round_trip_and_architecture(make_config, convolutions: dict) -> None:
    cfg = lilicorr_config(make_config, **convolutions)
    d = cfg.to_dict()
    assert d["architectures"] == ["LiLiCorrDraftModel"] and cfg.architecture == d["architectures"][0]
    assert d["dflash_config"]["lilicorr_candidate_topk"] == 4
    assert DFlashConfig.from_dict(d) == cfg
    assert cfg.has_convs == bool(convolutions) and not cfg.is_dflash2


def test_config_reads_vllms_defaults(make_config) -> None:
    """lilicorr_hidden_size null means the drafter's width; conv keys 0 mean no convolutions."""
    d = lilicorr_config(make_config).to_dict()
    d["dflash_config"] |= {"lilicorr_hidden_size": None, "conv_kernel_size": 0,
                           "conv_group_size": 0}
    cfg = DFlashConfig.from_dict(d)
    assert cfg.lilicorr.hidden_size == 128 and not cfg.has_convs


@pytest.mark.parametrize("change, message", [
    ({"lilicorr_candidate_topk": 3}, "lilicorr_candidate_topk 3 must be a power of two"),
    ({"lilicorr_candidate_topk": 32}, "lilicorr_candidate_topk 32 must be a power of two"),
    ({"lilicorr_num_heads": 3}, "lilicorr_num_heads 3 does not divide"),
    ({"lilicorr_factor_dim": None}, "['lilicorr_factor_dim']"),
    ({"lilicorr_enabled": False}, "lilicorr_enabled false"),
    ({"selector_top_k": 4}, "selector_rank/selector_top_k"),
    ({"conv_kernel_size": 3}, "the convolutions need both"),
])
def test_config_errors_name_the_key(make_config, change: dict, message: str) -> None:
    d = lilicorr_config(make_config).to_dict()
    d["dflash_config"] |= change
    with pytest.raises(DFlashConfigError, match="fix:") as err:
        DFlashConfig.from_dict(d)
    assert message in str(err.value)


def test_own_lm_head_is_read_for_lilicorr_only(make_config) -> None:
    cfg = lilicorr_config(make_config, has_own_lm_head=True)
    assert cfg.to_dict()["has_own_lm_head"] is True
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg
    dflash = make_config().to_dict() | {"has_own_lm_head": True}
    assert not DFlashConfig.from_dict(dflash).has_own_lm_head


# ---------------------------------------------------------------------------- the head


def random_head_inputs(cfg: DFlashConfig, num_reqs: int, num_slots: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_reqs, num_slots, cfg.hidden_size, generator=gen)
    logits = 2 * torch.randn(num_reqs, num_slots, cfg.vocab_size, generator=gen)
    table = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
    anchor_states = torch.randn(num_reqs, cfg.hidden_size, generator=gen)
    anchors = torch.randint(cfg.vocab_size, (num_reqs,), generator=gen)
    return hidden, logits, SelectorInputs(anchors, anchor_states, lambda ids: table[ids])


@torch.inference_mode()
def test_head_matches_vllm(make_config, tmp_path: Path) -> None:
    """Edge scores equal vLLM 0.32's LiLiCorrHead on the same weights and inputs: a head
    narrower than the drafter (vLLM's token_proj then exists) and as wide, drafts of the full
    block and shorter ones."""
    cases = {"narrow-full-block": (64, 7), "narrow-short-draft": (64, 3), "wide": (128, 5)}
    ours, paths = {}, []
    for name, (head_width, num_slots) in cases.items():
        cfg = lilicorr_config(make_config, lilicorr=replace(LILICORR, hidden_size=head_width))
        head = random_drafter(cfg, seed=1).lilicorr
        gen = torch.Generator().manual_seed(2)
        for param in head.parameters():  # larger than the random drafter's: every part counts
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))
        hidden, logits, inputs = random_head_inputs(cfg, num_reqs=3, num_slots=num_slots, seed=3)
        candidates, scores = head.edge_scores(hidden, logits, inputs)
        log_probs, ids = logits.log_softmax(dim=-1).topk(LILICORR.candidate_topk, dim=-1)
        assert torch.equal(candidates, ids)
        # The scores choose: the walk's drafts are not the logits' argmax everywhere.
        assert (walk(candidates, scores.argmax(dim=-1))[0] != logits.argmax(dim=-1)).any()
        ours[name] = scores
        config = cfg.lilicorr.to_dflash_config()
        torch.save({"model_hidden_size": cfg.hidden_size, "block_size": cfg.block_size,
                    "eps": cfg.rms_norm_eps, "config": config, "state": head.state_dict(),
                    "args": (inputs.embed(ids), log_probs, hidden, inputs.anchor_states,
                             torch.ones(3, dtype=torch.bool))},
                   tmp_path / f"{name}.in.pt")
        paths += [str(tmp_path / f"{name}.in.pt"), str(tmp_path / f"{name}.out.pt")]
    result = subprocess.run([sys.executable, "-m", "tests.vllm_lilicorr_head", *paths],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    for name, scores in ours.items():
        torch.testing.assert_close(scores, torch.load(tmp_path / f"{name}.out.pt"),
                                   atol=1e-4, rtol=1e-4, msg=name)


def test_checkpoint_round_trip(make_config, tmp_path: Path) -> None:
    cfg = lilicorr_config(make_config, conv_kernel_size=3, conv_group_size=32,
                          has_own_lm_head=True)
    drafter = random_drafter(cfg, seed=4)
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path)
    assert loaded.cfg == cfg and loaded.selector is loaded.lilicorr
    keys = set(loaded.state_dict())
    assert {"lilicorr.layers.1.attn.in_proj_weight", "lilicorr.token_proj.weight",
            "lm_head.weight"} <= keys
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


# ---------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    from vllm_dflash.tiny import write_random_drafter, write_random_target

    root = tmp_path_factory.mktemp("lilicorr")
    target = write_random_target(root / "target")
    write_random_drafter(root / "drafter", target, block_size=8,
                         head={"lilicorr": LILICORR, "conv_kernel_size": 3,
                               "conv_group_size": 16})
    write_random_drafter(root / "drafter-own-lm-head", target, block_size=8,
                         head={"lilicorr": LILICORR, "has_own_lm_head": True})
    return Pair(target=target, drafter=root / "drafter", block_size=8)


def _logits_source(worker) -> str:
    drafter = worker.model_runner.drafter.draft_runner
    return "own" if drafter.logits is drafter.drafter.lm_head else "target"


@pytest.fixture(scope="module")
def prompts(pair) -> list[dict]:
    return prompts_of_lengths(pair.target, (1, 9, 57, 200))


@pytest.fixture(scope="module")
def baseline(pair, prompts) -> list[list[int]]:
    return greedy_baseline(pair.target, prompts, max_tokens=40, max_num_seqs=4)


@pytest.mark.parametrize("speculative, drafter", [
    ({}, "drafter"),
    ({"draft_sample_method": "probabilistic"}, "drafter-own-lm-head"),
], ids=["greedy-drafts", "probabilistic-drafts-own-lm-head"])
def test_engine_is_lossless_and_reproducible(pair, prompts, baseline, speculative: dict,
                                             drafter: str, monkeypatch) -> None:
    import vllm_dflash.draft_sampling

    monkeypatch.setenv("VLLM_DFLASH_DRAFT_LENGTH", "fixed")  # a random drafter: keep drafting
    heads = []  # the engine runs in this process (tests' default)
    select = vllm_dflash.draft_sampling.select_drafts

    def counted_select(selector, hidden, logits, inputs, sampling):
        heads.append((type(selector).__name__, inputs.anchor_states.abs().sum().item() > 0,
                      sampling is not None and bool(sampling.sampled.any())))
        return select(selector, hidden, logits, inputs, sampling)

    monkeypatch.setattr(vllm_dflash.draft_sampling, "select_drafts", counted_select)
    pair = replace(pair, drafter=pair.drafter.parent / drafter)
    llm = dflash_llm(pair, num_speculative_tokens=5, speculative=speculative, max_num_seqs=4)
    assert llm.collective_rpc(_logits_source) == ["own" if "own" in drafter else "target"]
    assert_lossless_and_reproducible(llm, prompts, baseline, max_tokens=40,
                                     num_speculative_tokens=5)
    # Every drafting step chose through the LiLiCorr head, with the requests' context states.
    assert heads and {name for name, _, _ in heads} == {"LiLiCorrHead"}
    assert all(has_state for _, has_state, _ in heads)
    assert any(sampled for _, _, sampled in heads) == bool(speculative)
