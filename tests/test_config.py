"""DFlashConfig parsing/validation and checkpoint load/save errors (vLLM imported by one test
only, for the start-up check)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from dflash.model import DFlashDraftModel, build_target_layer_ids
from safetensors.torch import load_file, save_file

from vllm_dflash.checkpoint import load_drafter, save_drafter
from vllm_dflash.config import (
    DFlashConfig,
    DFlashConfigError,
    default_target_layer_ids,
    validate_against_target,
)
from vllm_dflash.tiny import (
    MASK_TOKEN,
    default_texts,
    random_drafter,
    write_random_drafter,
    write_random_target,
)


def qwen3_8b_b16() -> dict:
    """Older z-lab schema: block_size and rope_theta at the top level."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "vocab_size": 151936,
        "layer_types": ["full_attention"] * 5,
        "use_sliding_window": False,
        "sliding_window": None,
        "block_size": 16,
        "num_target_layers": 36,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    }


def newer_schema() -> dict:
    """Newer schema: block_size inside dflash_config (wins), rope_parameters, sliding layers."""
    d = qwen3_8b_b16()
    del d["rope_theta"], d["rope_scaling"]
    d |= {
        "rope_parameters": {"rope_theta": 5e6, "rope_type": "default"},
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "use_sliding_window": True,
        "sliding_window": 2048,
        "block_size": 8,
    }
    d["dflash_config"] |= {"block_size": 10, "causal": False, "output_multiplier": 0.5}
    return d


def test_older_schema() -> None:
    cfg = DFlashConfig.from_dict(qwen3_8b_b16())
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (5, 32, 8, 128)
    assert (cfg.block_size, cfg.mask_token_id, cfg.rope_theta) == (16, 151669, 1e6)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.num_target_layers == 36
    assert cfg.sliding_window is None and cfg.causal is None
    assert [cfg.layer_is_causal(i) for i in range(5)] == [False] * 5
    assert (cfg.output_multiplier, cfg.final_logit_softcapping) == (1.0, None)


def test_newer_schema() -> None:
    cfg = DFlashConfig.from_dict(newer_schema())
    assert (cfg.block_size, cfg.rope_theta, cfg.sliding_window) == (10, 5e6, 2048)
    assert cfg.output_multiplier == 0.5
    # An explicit causal flag applies to every layer, sliding ones included (as the reference).
    assert [cfg.layer_is_causal(i) for i in range(5)] == [False] * 5
    assert [cfg.layer_window(i) for i in range(5)] == [2048] * 4 + [None]


def test_sliding_layers_causal_by_default() -> None:
    d = newer_schema()
    del d["dflash_config"]["causal"]
    cfg = DFlashConfig.from_dict(d)
    assert [cfg.layer_is_causal(i) for i in range(5)] == [True] * 4 + [False]
    d["is_causal"] = True  # top-level flag wins over dflash_config.causal, as in vLLM
    d["dflash_config"]["causal"] = False
    assert DFlashConfig.from_dict(d).layer_is_causal(4)


def test_defaults() -> None:
    d = qwen3_8b_b16()
    for key in ("block_size", "num_key_value_heads", "layer_types", "rope_theta"):
        del d[key]
    del d["dflash_config"]["target_layer_ids"]
    cfg = DFlashConfig.from_dict(d)
    assert cfg.block_size == 16 and cfg.num_kv_heads == 32 and cfg.rope_theta == 10000.0
    assert cfg.layer_types == ["full_attention"] * 5
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]


@pytest.mark.parametrize("num_target_layers, num_features", [(36, 5), (36, 1), (28, 3), (8, 2)])
def test_default_target_layer_ids_match_reference(num_target_layers, num_features) -> None:
    expected = build_target_layer_ids(num_target_layers, num_features)
    assert default_target_layer_ids(num_target_layers, num_features) == expected


def test_parse_errors() -> None:
    d = qwen3_8b_b16()
    del d["dflash_config"]
    with pytest.raises(DFlashConfigError, match="no dflash_config.*fix"):
        DFlashConfig.from_dict(d)
    d = qwen3_8b_b16()
    del d["dflash_config"]["mask_token_id"]
    with pytest.raises(DFlashConfigError, match="missing mask_token_id \\(in dflash_config.*fix"):
        DFlashConfig.from_dict(d)
    d = qwen3_8b_b16() | {"architectures": ["DFlash2DraftModel"]}
    with pytest.raises(DFlashConfigError, match="'DFlash2DraftModel'.*none of.*fix"):
        DFlashConfig.from_dict(d)
    d = qwen3_8b_b16() | {"architectures": ["LiLiCorrDraftModel"]}
    with pytest.raises(DFlashConfigError, match="LiLiCorrDraftModel config needs.*lilicorr_.*fix"):
        DFlashConfig.from_dict(d)
    d = qwen3_8b_b16() | {"rope_scaling": {"type": "yarn", "factor": 4.0}}
    with pytest.raises(DFlashConfigError, match="rope_scaling.rope_type is 'yarn'.*fix"):
        DFlashConfig.from_dict(d)
    d = newer_schema()
    d["rope_parameters"]["rope_type"] = "llama3"
    with pytest.raises(DFlashConfigError, match="rope_parameters.rope_type is 'llama3'.*fix"):
        DFlashConfig.from_dict(d)


def test_to_dict_round_trip() -> None:
    for d in (qwen3_8b_b16(), newer_schema()):
        cfg = DFlashConfig.from_dict(d)
        written = cfg.to_dict()
        assert written["architectures"] == ["DFlashDraftModel"]
        assert written["model_type"] == "qwen3"
        assert written["block_size"] == written["dflash_config"]["block_size"] == cfg.block_size
        assert DFlashConfig.from_dict(written) == cfg


TARGET = {"target_hidden_size": 4096, "target_num_layers": 36, "target_vocab_size": 151936}
VALIDATION_ERRORS = [
    # (DFlashConfig change, validate_against_target change, words the message must contain)
    ({}, {"fc_in_features": 4096 * 4}, ["fc.weight", "16384", "20480", "fix"]),
    ({}, {"target_hidden_size": 2048}, ["fc.weight", "20480", "10240", "2048", "fix"]),
    ({"target_layer_ids": [1, 35]}, {}, ["target_layer_ids", "35", "[0, 35)", "fix"]),
    ({"target_layer_ids": [-1]}, {}, ["target_layer_ids", "-1", "36 layers", "fix"]),
    ({"mask_token_id": 151936}, {}, ["mask_token_id", "151936", "[0, 151936)", "fix"]),
    ({}, {"target_vocab_size": 160000}, ["vocab_size", "151936", "160000", "fix"]),
    ({}, {"num_speculative_tokens": 16}, ["num_speculative_tokens", "16", "15", "fix"]),
    ({}, {"num_speculative_tokens": 0}, ["num_speculative_tokens", "0", "[1, 15]", "fix"]),
    ({"head_dim": 48}, {}, ["head_dim", "48", "128", "fix"]),
    ({}, {"dtype": "float64"}, ["dtype", "float64", "bfloat16", "fix"]),
    ({}, {"dtype": torch.float8_e4m3fn}, ["dtype", "float8_e4m3fn", "float16", "fix"]),
]


@pytest.mark.parametrize("config_change, target_change, words", VALIDATION_ERRORS)
def test_validation_errors(config_change, target_change, words) -> None:
    cfg = replace(DFlashConfig.from_dict(qwen3_8b_b16()), **config_change)
    with pytest.raises(DFlashConfigError) as error:
        validate_against_target(cfg, **(TARGET | target_change))
    for word in words:
        assert word in str(error.value)


def test_validation_passes() -> None:
    cfg = DFlashConfig.from_dict(qwen3_8b_b16())
    for n, dtype in [(1, "bf16"), (15, torch.float16), (None, "float32")]:
        validate_against_target(
            cfg, **TARGET, num_speculative_tokens=n, fc_in_features=5 * 4096, dtype=dtype
        )


@pytest.fixture
def checkpoint(make_config, tmp_path: Path) -> Path:
    save_drafter(random_drafter(make_config(), seed=0), tmp_path / "drafter")
    return tmp_path / "drafter"


def rewrite_weights(path: Path, change) -> None:
    state = load_file(path / "model.safetensors")
    change(state)
    save_file(state, path / "model.safetensors")


def test_load_errors(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(DFlashConfigError, match="does not exist.*fix"):
        load_drafter(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DFlashConfigError, match="no config.json.*fix"):
        load_drafter(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(DFlashConfigError, match="no \\*.safetensors.*fix"):
        load_drafter(tmp_path / "empty")


def test_load_missing_key(checkpoint: Path) -> None:
    rewrite_weights(checkpoint, lambda state: state.pop("layers.1.mlp.up_proj.weight"))
    with pytest.raises(DFlashConfigError) as error:
        load_drafter(checkpoint)
    for word in ["layers.1.mlp.up_proj.weight", "[256, 128]", "missing", "fix"]:
        assert word in str(error.value)


def test_load_wrong_shape(checkpoint: Path) -> None:
    rewrite_weights(checkpoint, lambda state: state.update({"fc.weight": torch.zeros(128, 384)}))
    with pytest.raises(DFlashConfigError) as error:
        load_drafter(checkpoint)
    for word in ["fc.weight", "[128, 256]", "[128, 384]", "fix"]:
        assert word in str(error.value)


def test_load_unexpected_key_and_shared_weights(checkpoint: Path) -> None:
    shared = {"embed_tokens.weight": torch.zeros(512, 128), "lm_head.weight": torch.zeros(512, 128)}
    rewrite_weights(checkpoint, lambda state: state.update(shared))
    load_drafter(checkpoint)  # the target's embedding/lm_head are ignored
    rewrite_weights(checkpoint, lambda state: state.update({"layers.0.extra": torch.zeros(1)}))
    with pytest.raises(DFlashConfigError, match="unexpected weights \\['layers.0.extra'\\].*fix"):
        load_drafter(checkpoint)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_save_load_round_trip(dtype: torch.dtype, make_config, tmp_path: Path) -> None:
    cfg = make_config(layer_types=["sliding_attention", "full_attention"], sliding_window=32)
    drafter = random_drafter(cfg, seed=0).to(dtype)
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path)
    assert loaded.cfg == cfg
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == str(dtype)[6:]
    for key, value in drafter.state_dict().items():
        assert loaded.state_dict()[key].dtype == dtype
        assert torch.equal(loaded.state_dict()[key], value)
    as_fp32 = load_drafter(tmp_path, dtype="fp32")
    assert all(p.dtype == torch.float32 for p in as_fp32.parameters())


def test_saved_drafter_loads_in_reference(checkpoint: Path) -> None:
    reference, info = DFlashDraftModel.from_pretrained(checkpoint, output_loading_info=True)
    assert not any(info.values()), info
    assert reference.block_size == 8 and reference.target_layer_ids == [2, 5]
    assert reference.mask_token_id == 1
    ours = load_drafter(checkpoint).state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(ours[key], value), key


def test_tiny_models(tmp_path: Path) -> None:
    from transformers import AutoTokenizer  # already imported by the reference package

    target_dir = write_random_target(
        tmp_path / "target", hidden_size=128, num_layers=4, texts=default_texts()[:1]
    )
    cfg = write_random_drafter(tmp_path / "drafter", target_dir, block_size=4)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    assert tokenizer.convert_tokens_to_ids(MASK_TOKEN) == cfg.mask_token_id
    assert tokenizer.decode(tokenizer("def f(x):\n    return x").input_ids) == (
        "def f(x):\n    return x"
    )
    target = json.loads((target_dir / "config.json").read_text())
    drafter = load_drafter(tmp_path / "drafter")
    validate_against_target(
        drafter.cfg,
        target_hidden_size=target["hidden_size"],
        target_num_layers=target["num_hidden_layers"],
        target_vocab_size=target["vocab_size"],
        num_speculative_tokens=3,
        fc_in_features=drafter.fc.weight.shape[1],
        dtype=target["dtype"],
    )


def test_qwen3_8b_drafter_starts_with_qwen3_8b_defaults(tmp_path: Path) -> None:
    # `vllm serve Qwen/Qwen3-8B --speculative-config {... z-lab/Qwen3-8B-DFlash-b16, K=15}`:
    # max_model_len defaults to Qwen3-8B's 40960, the drafter's max_position_embeddings too.
    from types import SimpleNamespace

    from tests.engines import speculative_config_stub
    from vllm_dflash.vllm.config import validate_speculative_config

    (tmp_path / "config.json").write_text(json.dumps(qwen3_8b_b16()))
    spec = speculative_config_stub(str(tmp_path), 15)
    target = SimpleNamespace(get_hidden_size=lambda: 4096, get_vocab_size=lambda: 151936,
                             hf_text_config=SimpleNamespace(num_hidden_layers=36),
                             dtype=torch.bfloat16, max_model_len=40960)
    cfg = validate_speculative_config(spec, target)
    assert cfg.block_size == 16 and cfg.target_layer_ids == [1, 9, 17, 25, 33]
