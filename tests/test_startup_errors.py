"""A drafter that does not fit its target fails engine start-up with vllm-dflash's message."""

import json
import shutil

import pytest

from tests.engines import dflash_llm


def edited_drafter(pair, tmp_path, edit):
    """A copy of the pair whose drafter config.json went through edit(dict)."""
    drafter = tmp_path / "drafter"
    shutil.copytree(pair.drafter, drafter)
    config = json.loads((drafter / "config.json").read_text())
    edit(config)
    (drafter / "config.json").write_text(json.dumps(config))
    return type(pair)(target=pair.target, drafter=drafter, block_size=pair.block_size)


def error_text(excinfo: pytest.ExceptionInfo) -> str:
    """The message and every cause in the chain (vLLM may wrap start-up errors)."""
    texts, err = [], excinfo.value
    while err is not None:
        texts.append(str(err))
        err = err.__cause__ or err.__context__
    return "\n".join(texts)


def set_layer_ids(ids):
    return lambda c: c["dflash_config"].update(target_layer_ids=ids)


CASES = {
    "layer id out of range": (set_layer_ids([0, 9]), ["target_layer_ids", "9", "fix"]),
    "mask id outside vocab": (
        lambda c: c["dflash_config"].update(mask_token_id=50_000),
        ["mask_token_id", "50000", "1024", "fix"],
    ),
    "vocab differs": (lambda c: c.update(vocab_size=2048), ["vocab_size", "2048", "1024", "fix"]),
    "no dflash_config": (lambda c: c.pop("dflash_config"), ["dflash_config"]),
    "head dim unsupported": (lambda c: c.update(head_dim=48), ["head_dim", "48"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_mismatch_fails_startup(random_pair, tmp_path, case):
    edit, words = CASES[case]
    bad = edited_drafter(random_pair, tmp_path, edit)
    with pytest.raises(Exception) as excinfo:
        dflash_llm(bad, 3)
    text = error_text(excinfo)
    for word in words:
        assert word in text, text


def test_feature_width_mismatch_fails_startup(random_pair, tmp_path):
    # A drafter made for a target with hidden size 128 cannot read this target's features.
    bad = edited_drafter(random_pair, tmp_path, lambda c: c.update(hidden_size=128))
    with pytest.raises(Exception) as excinfo:
        dflash_llm(bad, 3)
    assert "fc.weight input width" in error_text(excinfo)


@pytest.mark.parametrize("k", [8, 20])
def test_too_many_speculative_tokens_fails_startup(random_pair, k):
    with pytest.raises(Exception) as excinfo:
        dflash_llm(random_pair, k)
    text = error_text(excinfo)
    assert "num_speculative_tokens" in text and str(k) in text and "7" in text, text


# Speculative-config keys vllm-dflash refuses: each with the words its message must hold.
REFUSED_KEYS = {
    "drafter kv_cache_dtype": ({"kv_cache_dtype": "fp8"},
                               ["kv_cache_dtype='fp8' for the drafter",
                                "fix: remove kv_cache_dtype"]),
    "unpadded drafter batch": ({"disable_padded_drafter_batch": True},
                               ["disable_padded_drafter_batch=True",
                                "remove disable_padded_drafter_batch"]),
    "drafter quantization": ({"quantization": "fp8"},
                             ["quantization='fp8' for the drafter", "fix: remove quantization"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED_KEYS))
def test_refused_speculative_config_keys_fail_startup(random_pair, case):
    speculative, words = REFUSED_KEYS[case]
    with pytest.raises(Exception) as excinfo:
        dflash_llm(random_pair, 3, speculative=speculative)
    text = error_text(excinfo)
    for word in words:
        assert word in text, text


def test_target_without_intermediate_hidden_states_fails_startup(random_pair, tmp_path):
    # GPT-2 has no aux-hidden-state interface in vLLM 0.32; widths match the drafter's target.
    from transformers import GPT2Config, GPT2LMHeadModel

    target = tmp_path / "gpt2"
    config = GPT2Config(vocab_size=1024, n_positions=4096, n_embd=256, n_layer=4, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(random_pair.target / name, target / name)
    gpt2_pair = type(random_pair)(target=target, drafter=random_pair.drafter,
                                  block_size=random_pair.block_size)
    with pytest.raises(Exception) as excinfo:
        dflash_llm(gpt2_pair, 3)
    text = error_text(excinfo)
    assert "target GPT2LMHeadModel does not return the hidden states" in text, text
    assert "fix: use a target architecture" in text, text
