"""Tiny local models (no downloads) for tests, examples and benchmarks.

`write_random_target` writes a Qwen3ForCausalLM directory (config, safetensors, tokenizer) that
transformers and vLLM's CPU build load offline; `write_random_drafter` writes a matching DFlash
drafter in the z-lab format.
"""

import json
import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from vllm_dflash.checkpoint import save_drafter
from vllm_dflash.config import DFlashConfig, resolve_dtype
from vllm_dflash.model import DFlashDrafter

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"  # the DFlash mask_token_id of the tiny drafters
# Plain "role: content" turns, so chat endpoints work without extra special tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# Local text to train the tokenizer on: a few standard-library modules, same on every machine.
DEFAULT_TEXT_MODULES = ("functools.py", "textwrap.py", "string.py", "bisect.py")


def default_texts() -> list[str]:
    stdlib = Path(os.__file__).parent
    return [(stdlib / name).read_text() for name in DEFAULT_TEXT_MODULES]


def write_tokenizer(out_dir: str | Path, texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on texts; save tokenizer.json + tokenizer_config.json.

    Ids 0 and 1 are the special tokens EOS_TOKEN and MASK_TOKEN; at most vocab_size tokens.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 2:
        raise ValueError(f"vocab_size {vocab_size} < {len(alphabet) + 2} (bytes + 2 specials)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, MASK_TOKEN],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return tokenizer


def write_random_target(
    out_dir: str | Path,
    *,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 512,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    dtype: str = "float32",
    texts: list[str] | None = None,
    tie_word_embeddings: bool = False,
) -> Path:
    """Random-weight Qwen3ForCausalLM + tokenizer in out_dir (transformers init: std 0.02)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM  # heavy import, only needed here

    out_dir = Path(out_dir)
    tokenizer = write_tokenizer(out_dir, texts or default_texts(), vocab_size)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(resolve_dtype(dtype))
    model.save_pretrained(out_dir)
    return out_dir


def random_drafter(
    cfg: DFlashConfig,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """Drafter with normal(0, 0.02) weights, unit norms and zero biases (non-degenerate); a
    DFlash2 drafter's convolutions start near the identity and its codebooks at normal(0, 1), so
    that the selector's edges can overrule the logits' order.

    Drawn where it lives: the ~1B parameters of a Qwen3-8B drafter take seconds on a GPU and
    far longer through a host-side init.
    """
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg).to(dtype)
    drafter = drafter.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            elif name.endswith("codebook"):
                param.normal_(0.0, 1.0, generator=generator)
            else:
                param.normal_(0.0, 0.02, generator=generator)
            if name.endswith("base_kernel"):
                param[:, 0] += 1.0
    return drafter


def spread_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Distinct ids over [0, T-2]. The published formula repeats ids on shallow tiny targets
    (T=4 gives [1, 1]), and vLLM captures each aux layer once, so repeats break serving."""
    last = num_target_layers - 2
    return [round(i * last / max(num_features - 1, 1)) for i in range(num_features)]


def write_random_drafter(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    block_size: int = 8,
    num_layers: int = 2,
    target_layer_ids: list[int] | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    seed: int = 0,
    sliding: tuple[list[str], int] | None = None,
    head: dict[str, Any] | None = None,
) -> DFlashConfig:
    """Random DFlash drafter for the target in target_dir (same hidden size, head_dim 64); of a
    multimodal target, for its language model (`text_config`). sliding: (layer_types,
    sliding_window) for sliding-window layers. head: DFlashConfig fields of a DFlash2 drafter
    (conv_kernel_size, conv_group_size, selector_rank, selector_top_k) or of a LiLiCorr one
    (lilicorr=LiLiCorrConfig(...), convolutions optional)."""
    target_dir = Path(target_dir)
    target = json.loads((target_dir / "config.json").read_text())
    target = {"dtype": target.get("dtype"), **target.get("text_config", target)}
    mask_id = Tokenizer.from_file(str(target_dir / "tokenizer.json")).token_to_id(MASK_TOKEN)
    num_heads = num_heads or target["hidden_size"] // 64
    num_kv_heads = num_kv_heads or target["num_key_value_heads"]
    cfg = DFlashConfig(
        hidden_size=target["hidden_size"],
        intermediate_size=target["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        rms_norm_eps=target["rms_norm_eps"],
        rope_theta=target["rope_parameters"]["rope_theta"],
        max_position_embeddings=target["max_position_embeddings"],
        vocab_size=target["vocab_size"],
        layer_types=sliding[0] if sliding else ["full_attention"] * num_layers,
        sliding_window=sliding[1] if sliding else None,
        block_size=block_size,
        mask_token_id=mask_id,
        target_layer_ids=target_layer_ids
        or spread_layer_ids(target["num_hidden_layers"], num_layers),
        num_target_layers=target["num_hidden_layers"],
        **(head or {}),
    )
    drafter = random_drafter(cfg, seed).to(resolve_dtype(target["dtype"] or "float32"))
    save_drafter(drafter, out_dir)
    return cfg
