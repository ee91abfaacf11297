"""Speculators-format DFlash and DFlash2 checkpoints (vllm-project/speculators' schema, which
vLLM's in-tree DFlash reads): config round trips through the schema, vLLM reads the written
configs as this package does, weights load equal, errors name the field and the fix; and a
speculators-format copy of the trained pair's drafter serves through LLM() with the output of
no speculation and the z-lab copy's acceptance."""

import json
from types import SimpleNamespace

import pytest
import torch

from tests.engines import (
    TRAINED,
    TRAINED_DFLASH2,
    Pair,
    dflash_llm,
    generate_ids,
    greedy_baseline,
    run_python,
    spec_metrics,
)
from vllm_dflash.checkpoint import load_drafter, save_drafter
from vllm_dflash.config import DFlashConfig, DFlashConfigError, LiLiCorrConfig
from vllm_dflash.speculators import from_dflash_config, is_dflash_config, to_zlab
from vllm_dflash.tiny import random_drafter

DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 32, "selector_rank": 16, "selector_top_k": 8}
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}
ALL_SLIDING = {"layer_types": ["sliding_attention"] * 2, "sliding_window": 64}
CONFIGS = {
    "dflash": {},
    "dflash2": DFLASH2,
    "causal": {"causal": True},
    "non-causal": {"causal": False},
    "sliding": SLIDING,
    "all-sliding": ALL_SLIDING,
    "sliding-non-causal": SLIDING | {"causal": False},
    "rope-theta": {"rope_theta": 1e6, "attention_bias": True, "block_size": 16},
}
MAX_TOKENS = 32
PAIRS = {"dflash": TRAINED, "dflash2": TRAINED_DFLASH2}


def speculators_checkpoint() -> dict:
    """A DFlash config.json as speculators writes one (its own fields, the verifier's layer
    config keys, no num_target_layers)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.4.0",
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 7,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]},
        },
        "transformer_layer_config": {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 3,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
            "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
            "layer_types": ["full_attention"] * 3, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": 36, "attention_bias": False,
        },
        "draft_vocab_size": 151936,
        "block_size": 8,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [2, 18, 33],
        "mask_token_id": 151669,
        "sliding_window_non_causal": False,
        "projector_type": "dflash",
        "shift_label": False,
        "sample_from_anchor": False,
        "transformers_version": "4.57.1",
        "dtype": "bfloat16",
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_round_trip(name, make_config):
    cfg = make_config(**CONFIGS[name])
    written = json.loads(json.dumps(from_dflash_config(cfg)))
    assert DFlashConfig.from_dict(to_zlab(written)) == cfg
    assert is_dflash_config(written)


@pytest.mark.parametrize("name", [name for name in CONFIGS if name not in ("sliding",
                                                                           "sliding-non-causal")])
def test_vllm_reads_the_written_config_as_this_package(name, make_config):
    """vLLM's own converter and its per-layer attention rules agree with DFlashConfig (where the
    layers are not mixed: for mixed ones vLLM applies sliding_window_non_causal to every
    layer, and needs its V2 runner)."""
    from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    cfg = make_config(**CONFIGS[name])
    written = json.loads(json.dumps(from_dflash_config(cfg)))
    assert SpeculatorsConfig.extract_vllm_speculative_config(written) == {
        "method": "dflash", "num_speculative_tokens": cfg.block_size - 1}
    hf = SpeculatorsConfig.extract_transformers_pre_trained_config(written)
    assert hf["architectures"] == [cfg.architecture]
    assert hf["dflash_config"]["target_layer_ids"] == cfg.target_layer_ids
    assert hf["dflash_config"]["mask_token_id"] == cfg.mask_token_id
    assert [hf["dflash_config"].get(key) for key in DFLASH2] == [
        getattr(cfg, key) for key in DFLASH2]
    vllm_layers = [_resolve_layer_attention(SimpleNamespace(**hf), i)
                   for i in range(cfg.num_layers)]
    assert vllm_layers == [(cfg.layer_window(i), cfg.layer_is_causal(i))
                           for i in range(cfg.num_layers)]


def test_reads_a_config_as_speculators_writes_it():
    d = speculators_checkpoint()
    cfg = DFlashConfig.from_dict(to_zlab(d))
    assert cfg.target_layer_ids == [1, 17, 32]  # aux_hidden_state_layer_ids - 1, as vLLM
    assert (cfg.mask_token_id, cfg.block_size, cfg.num_layers, cfg.num_kv_heads) == (
        151669, 8, 3, 8)
    assert cfg.rope_theta == 1e6 and cfg.sliding_window is None and cfg.causal is None
    assert cfg.num_target_layers == 34  # the least depth the ids fit (none recorded)
    assert [cfg.layer_is_causal(i) for i in range(3)] == [False] * 3
    del d["block_size"]
    assert DFlashConfig.from_dict(to_zlab(d)).block_size == 8  # speculative_tokens + 1
    d |= DFLASH2 | {"speculators_model_type": "dflash2"}
    assert DFlashConfig.from_dict(to_zlab(d)).architecture == "DFlash2DraftModel"


@pytest.mark.parametrize("name", list(PAIRS))
def test_weights_load_equal(name, tmp_path):
    pair = PAIRS[name]
    drafter = load_drafter(pair.drafter)
    save_drafter(drafter, tmp_path, schema="speculators", verifier=pair.target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": str(pair.target), "architectures": ["Qwen3ForCausalLM"]}
    loaded = load_drafter(tmp_path)
    assert loaded.cfg == drafter.cfg
    want, got = drafter.state_dict(), loaded.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[key], want[key]) and got[key].dtype == want[key].dtype
               for key in want)


ERRORS = {
    "eagle3": ({"speculators_model_type": "eagle3"}, "not a DFlash drafter"),
    "no layer config": ({"transformer_layer_config": None}, "no transformer_layer_config"),
    "no aux ids": ({"aux_hidden_state_layer_ids": []}, "['aux_hidden_state_layer_ids']"),
    "no mask": ({"mask_token_id": None}, "['mask_token_id']"),
    "anchor": ({"sample_from_anchor": True}, "sample_from_anchor is true"),
    "draft vocab": ({"draft_vocab_size": 32000}, "reduced draft vocabulary"),
    "target hidden": ({"target_hidden_size": 5120}, "target_hidden_size 5120"),
    "domino": ({"projector_type": "domino"}, "projector_type 'domino'"),
    "no block size": ({"block_size": None, "speculators_config": {}}, "neither block_size"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_name_the_field_and_the_fix(name):
    change, message = ERRORS[name]
    with pytest.raises(DFlashConfigError, match="fix: ") as error:
        DFlashConfig.from_dict(to_zlab(speculators_checkpoint() | change))
    assert message in str(error.value)


def test_layer_config_errors():
    d = speculators_checkpoint()
    del d["transformer_layer_config"]["head_dim"]
    with pytest.raises(DFlashConfigError, match=r"missing \['head_dim'\].*fix: "):
        to_zlab(d)
    d = speculators_checkpoint()
    d["transformer_layer_config"]["layer_types"] = ["sliding_attention"] * 3
    with pytest.raises(DFlashConfigError, match="no sliding_window; fix: "):
        to_zlab(d)


def test_writer_refuses_what_the_schema_cannot_hold(make_config, tmp_path):
    with pytest.raises(DFlashConfigError, match="output_multiplier.*fix: save this drafter in"):
        from_dflash_config(make_config(output_multiplier=2.0))
    lilicorr = LiLiCorrConfig(candidate_topk=4, hidden_size=128, num_layers=1, num_heads=2,
                              mlp_ratio=2.0, factor_dim=8, vector_eps=1e-6, logit_scale=16.0)
    with pytest.raises(DFlashConfigError, match="LiLiCorr drafter has no speculators form"):
        from_dflash_config(make_config(lilicorr=lilicorr))
    with pytest.raises(DFlashConfigError, match="schema 'hf'; fix: "):
        save_drafter(random_drafter(make_config()), tmp_path, schema="hf")
    assert not tmp_path.joinpath("config.json").exists()


def test_is_dflash_config():
    assert is_dflash_config(speculators_checkpoint())
    assert is_dflash_config(speculators_checkpoint() | {"architectures": ["DFlashSpeculator"]})
    assert not is_dflash_config(speculators_checkpoint() | {"speculators_model_type": "eagle3"})
    assert is_dflash_config({"architectures": ["DFlash2DraftModel"]})
    assert not is_dflash_config({"architectures": ["Qwen3ForCausalLM"]})


# ---- the trained pair through LLM() -------------------------------------------------------


@pytest.fixture(scope="module")
def baseline(prompts) -> list[list[int]]:
    return greedy_baseline(TRAINED.target, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def runs(prompts, tmp_path_factory) -> dict[tuple[str, str], tuple[list[list[int]], dict]]:
    """Greedy output and spec-decode counters of each trained drafter (DFlash, DFlash2) in the
    z-lab schema and in the speculators schema."""
    result = {}
    for name, pair in PAIRS.items():
        spec_dir = tmp_path_factory.mktemp(f"{name}-speculators")
        save_drafter(load_drafter(pair.drafter), spec_dir, schema="speculators",
                     verifier=pair.target)
        for schema, drafter in (("z-lab", pair.drafter), ("speculators", spec_dir)):
            llm = dflash_llm(Pair(pair.target, drafter, pair.block_size), pair.block_size - 1)
            got = generate_ids(llm, prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
            result[name, schema] = got, spec_metrics(llm)
            del llm
    return result


@pytest.mark.parametrize("name", list(PAIRS))
def test_speculators_drafter_is_lossless_through_llm(name, runs, baseline):
    assert runs[name, "speculators"][0] == baseline
    assert runs[name, "z-lab"][0] == baseline


@pytest.mark.parametrize("name", list(PAIRS))
def test_speculators_drafter_has_the_zlab_acceptance(name, runs):
    metrics = runs[name, "speculators"][1]
    assert metrics["accepted"] > metrics["drafts"] > 0  # real acceptance: > 1 token a draft
    assert metrics == runs[name, "z-lab"][1]


IN_TREE_SCRIPT = """
import json, sys
from tests.engines import Pair, dflash_llm, generate_ids, heldout_ids, spec_metrics

target, block_size, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts = [{"prompt_token_ids": ids} for ids in heldout_ids()]
for drafter in sys.argv[4:]:
    llm = dflash_llm(Pair(target, drafter, block_size), block_size - 1)
    ids = generate_ids(llm, prompts, max_tokens=max_tokens, ignore_eos=True)
    print("RESULT " + json.dumps({"ids": ids, "metrics": spec_metrics(llm)}), flush=True)
    del llm
"""


def test_vllm_in_tree_dflash_serves_the_written_checkpoint(baseline, tmp_path):
    """vLLM's own DFlash (VLLM_DFLASH_IMPL=vllm) loads save_drafter's speculators checkpoint:
    the output of no speculation, and the z-lab copy's acceptance."""
    save_drafter(load_drafter(TRAINED.drafter), tmp_path, schema="speculators",
                 verifier=TRAINED.target)
    zlab, speculators = run_python(
        IN_TREE_SCRIPT, str(TRAINED.target), str(TRAINED.block_size), str(MAX_TOKENS),
        str(TRAINED.drafter), str(tmp_path), VLLM_DFLASH_IMPL="vllm",
        VLLM_ENABLE_V1_MULTIPROCESSING="0")
    assert speculators["ids"] == zlab["ids"] == baseline
    assert speculators["metrics"] == zlab["metrics"]
    assert speculators["metrics"]["accepted"] > speculators["metrics"]["drafts"] > 0
