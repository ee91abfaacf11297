"""Targets of other architectures than the dense Qwen3 of the other tests (random weights, a
tiny tokenizer): vLLM's model classes capture the drafter's features and expose the embedding
and lm_head the drafter uses, so greedy output equals no speculation for a mixture-of-experts
Qwen3, a Qwen3 whose lm_head is its embedding (tied, as in the small Qwen3 models), Qwen2, Llama
and Qwen3-VL (M-RoPE positions, text prompts).

The engines run in a script of their own (this file): vLLM sets up a mixture-of-experts
model's expert-parallel group only in a process whose distributed state is still fresh. That
script sees a stub `torchvision` (written by the fixture): the CPU build runs without
torchvision, and transformers' Qwen2-VL image processor, which vLLM's Qwen3-VL imports, needs
the package to import; text prompts never call it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
FAMILIES = ("qwen3_moe", "qwen3_tied", "qwen2", "llama", "qwen3_vl")
VOCAB = 1024  # the tokenizer's; Qwen3-VL's vision tokens sit above it
WIDTHS = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 4096, "tie_word_embeddings": False}
# Enough of torchvision's names for transformers' image-processing modules to import.
TORCHVISION_STUB = {
    "__init__.py": '__version__ = "0.0"\n',
    "io/__init__.py": "ImageReadMode = decode_image = None\n",
    "transforms/__init__.py": (
        "import enum\n"
        "InterpolationMode = enum.Enum('InterpolationMode', ['NEAREST', 'NEAREST_EXACT', "
        "'BILINEAR', 'BICUBIC', 'BOX', 'HAMMING', 'LANCZOS'])\n"),
    "transforms/functional.py": "pil_to_tensor = None\n",
    "transforms/v2/__init__.py": "",
    "transforms/v2/functional.py": "",
}


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
    if family == "qwen3_vl":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 8, 8],
                "mrope_interleaved": True}
        text = WIDTHS | ids | {"vocab_size": VOCAB + 4, "head_dim": 64, "rope_parameters": rope}
        vision = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                  "out_hidden_size": 256, "deepstack_visual_indexes": [0],
                  "num_position_embeddings": 64}
        return transformers.Qwen3VLConfig(
            text_config=text, vision_config=vision, image_token_id=VOCAB,
            video_token_id=VOCAB + 1, vision_start_token_id=VOCAB + 2,
            vision_end_token_id=VOCAB + 3, tie_word_embeddings=False)
    return transformers.LlamaConfig(**WIDTHS, **ids, head_dim=64)


def write_pair(root: Path, family: str):
    """A random target of `family` with a tiny tokenizer, and a random drafter for it."""
    import transformers

    from tests.engines import Pair
    from vllm_dflash.tiny import EOS_TOKEN, default_texts, write_random_drafter, write_tokenizer

    target = root / family
    tokenizer = write_tokenizer(target, default_texts(), VOCAB)
    torch.manual_seed(0)
    config = hf_config(family, tokenizer.token_to_id(EOS_TOKEN))
    if family == "qwen3_vl":
        model = transformers.Qwen3VLForConditionalGeneration(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(target)
    write_random_drafter(root / f"{family}_drafter", target, block_size=8)
    return Pair(target=target, drafter=root / f"{family}_drafter", block_size=8)


def run_engines(root: Path) -> dict:
    """Script entry: per family, the outputs without and with speculation."""
    from tests.engines import dflash_llm, generate_ids, plain_llm, prompts_of_lengths

    greedy = {"max_tokens": 40, "ignore_eos": True}
    text_only = {"limit_mm_per_prompt": {"image": 0, "video": 0}}
    result = {}
    for family in FAMILIES:
        pair = write_pair(root, family)
        engine = text_only if family == "qwen3_vl" else {}
        prompts = prompts_of_lengths(pair.target, (1, 7, 40, 130))
        llm = plain_llm(pair.target, **engine)
        result[family] = {"plain": generate_ids(llm, prompts, **greedy)}
        del llm
        llm = dflash_llm(pair, pair.block_size - 1, **engine)
        result[family]["dflash"] = generate_ids(llm, prompts, **greedy)
        del llm
    return result


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("families")
    for name, text in TORCHVISION_STUB.items():
        path = root / "stub" / "torchvision" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    paths = [str(REPO), str(root / "stub"), os.environ.get("PYTHONPATH")]
    proc = subprocess.run([sys.executable, __file__, str(root)],
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths))),
                          cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    out = root / "result.json"
    assert proc.returncode == 0 and out.exists(), proc.stdout[-5000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_no_speculation(outputs, family):
    assert outputs[family]["dflash"] == outputs[family]["plain"]


if __name__ == "__main__":
    root = Path(sys.argv[1])
    (root / "result.json").write_text(json.dumps(run_engines(root)))
