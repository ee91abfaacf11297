"""Targets of other architectures than Qwen3 (random weights, the tiny tokenizer): vLLM's model
classes capture the drafter's features and expose the embedding and lm_head the drafter uses,
so greedy output equals no speculation for a mixture-of-experts Qwen3, Qwen2 and Llama."""

from pathlib import Path

import pytest
import torch

from tests.engines import Pair, dflash_llm, generate_ids, plain_llm, prompts_of_lengths

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
    if family == "qwen2":
        return transformers.Qwen2Config(**WIDTHS, **ids)
    return transformers.LlamaConfig(**WIDTHS, **ids, head_dim=64)


def write_pair(root: Path, family: str) -> Pair:
    """A random target of `family` with the tiny Qwen3 target's tokenizer, and a drafter."""
    from transformers import AutoModelForCausalLM

    from vllm_dflash.tiny import EOS_TOKEN, default_texts, write_random_drafter, write_tokenizer

    target = root / family
    tokenizer = write_tokenizer(target, default_texts(), WIDTHS["vocab_size"])
    torch.manual_seed(0)
    config = hf_config(family, tokenizer.token_to_id(EOS_TOKEN))
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    write_random_drafter(root / f"{family}_drafter", target, block_size=8)
    return Pair(target=target, drafter=root / f"{family}_drafter", block_size=8)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2", "llama"])
def test_greedy_equals_no_speculation(tmp_path, family):
    pair = write_pair(tmp_path, family)
    prompts = prompts_of_lengths(pair.target, (1, 7, 40, 130))
    greedy = {"max_tokens": 40, "ignore_eos": True}
    llm = plain_llm(pair.target)
    want = generate_ids(llm, prompts, **greedy)
    del llm
    llm = dflash_llm(pair, pair.block_size - 1)
    assert generate_ids(llm, prompts, **greedy) == want
