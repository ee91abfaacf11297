"""Targets of other architectures than Qwen3 (random weights, the tiny tokenizer): vLLM's model
classes capture the drafter's features and expose the embedding and lm_head the drafter uses,
so greedy output equals no speculation for a mixture-of-experts Qwen3, a Qwen3 whose lm_head is
its embedding (tied, as in the small Qwen3 models), Qwen2 and Llama.

The engines run in a script of their own (this file): vLLM sets up a mixture-of-experts
model's expert-parallel group only in a process whose distributed state is still fresh."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
FAMILIES = ("qwen3_moe", "qwen3_tied", "qwen2", "llama")
WIDTHS = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 4096, "tie_word_embeddings": False}


def hf_config(family: str, eos_id: int):
    import transformers

    ids = {"bos_token_id": eos_id, "eos_token_id": eos_id}
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **WIDTHS, **ids, head_dim=64, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=128, decoder_sparse_step=1, norm_topk_prob=True)
    if family == "qwen3_tied":
        return transformers.Qwen3Config(**(WIDTHS | {"tie_word_embeddings": True}), **ids,
                                        head_dim=64)
    if family == "qwen2":
        return transformers.Qwen2Config(**WIDTHS, **ids)
    return transformers.LlamaConfig(**WIDTHS, **ids, head_dim=64)


def write_pair(root: Path, family: str):
    """A random target of `family` with a tiny tokenizer, and a random drafter for it."""
    from transformers import AutoModelForCausalLM

    from tests.engines import Pair
    from vllm_dflash.tiny import EOS_TOKEN, default_texts, write_random_drafter, write_tokenizer

    target = root / family
    tokenizer = write_tokenizer(target, default_texts(), WIDTHS["vocab_size"])
    torch.manual_seed(0)
    config = hf_config(family, tokenizer.token_to_id(EOS_TOKEN))
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    write_random_drafter(root / f"{family}_drafter", target, block_size=8)
    return Pair(target=target, drafter=root / f"{family}_drafter", block_size=8)


def run_engines(root: Path) -> dict:
    """Script entry: per family, the outputs without and with speculation."""
    from tests.engines import dflash_llm, generate_ids, plain_llm, prompts_of_lengths

    greedy = {"max_tokens": 40, "ignore_eos": True}
    result = {}
    for family in FAMILIES:
        pair = write_pair(root, family)
        prompts = prompts_of_lengths(pair.target, (1, 7, 40, 130))
        llm = plain_llm(pair.target)
        result[family] = {"plain": generate_ids(llm, prompts, **greedy)}
        del llm
        llm = dflash_llm(pair, pair.block_size - 1)
        result[family]["dflash"] = generate_ids(llm, prompts, **greedy)
        del llm
    return result


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("families")
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__, str(root)],
                          env=dict(os.environ, PYTHONPATH=pythonpath), cwd=REPO,
                          capture_output=True, text=True, timeout=900, check=False)
    out = root / "result.json"
    assert proc.returncode == 0 and out.exists(), proc.stdout[-5000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_no_speculation(outputs, family):
    assert outputs[family]["dflash"] == outputs[family]["plain"]


if __name__ == "__main__":
    root = Path(sys.argv[1])
    (root / "result.json").write_text(json.dumps(run_engines(root)))
