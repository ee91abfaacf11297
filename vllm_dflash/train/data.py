"""Training examples as token ids: a prompt and, unless it is to be regenerated, a response.

Sources: a JSONL of {"prompt": str[, "response": str]} or {"messages": [...]} (chat, rendered
with the tokenizer's chat template when it has one; a final assistant message is the response),
or a folder of text files, each cut into windows of prompt + continuation tokens.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase


@dataclass
class Example:
    prompt_ids: list[int]
    response_ids: list[int]


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """The messages rendered for generation: chat template, else contents one per line."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return encode(tokenizer, text)
    return encode(tokenizer, "".join(m["content"] + "\n" for m in messages))


def record_example(tokenizer: PreTrainedTokenizerBase, record: dict) -> Example:
    if "messages" in record:
        messages = record["messages"]
        if messages and messages[-1]["role"] == "assistant":
            response = encode(tokenizer, messages[-1]["content"]) + [tokenizer.eos_token_id]
            return Example(chat_prompt(tokenizer, messages[:-1]), response)
        return Example(chat_prompt(tokenizer, messages), [])
    return Example(
        encode(tokenizer, record["prompt"]), encode(tokenizer, record.get("response", ""))
    )


def jsonl_examples(tokenizer: PreTrainedTokenizerBase, path: Path) -> list[Example]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [record_example(tokenizer, json.loads(line)) for line in lines if line.strip()]


def text_examples(
    tokenizer: PreTrainedTokenizerBase, folder: Path, prompt_tokens: int, response_tokens: int
) -> list[Example]:
    """Every file under folder cut into [prompt_tokens | response_tokens] windows."""
    window = prompt_tokens + response_tokens
    examples = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        ids = encode(tokenizer, path.read_text(encoding="utf-8", errors="replace"))
        for start in range(0, len(ids) - prompt_tokens - 1, window):
            chunk = ids[start : start + window]
            examples.append(Example(chunk[:prompt_tokens], chunk[prompt_tokens:]))
    return examples


def load_examples(
    tokenizer: PreTrainedTokenizerBase, path: Path, prompt_tokens: int, response_tokens: int
) -> list[Example]:
    """Examples from a JSONL file or a folder of text files (see the module docstring)."""
    if path.is_dir():
        return text_examples(tokenizer, path, prompt_tokens, response_tokens)
    return jsonl_examples(tokenizer, path)
