"""Training examples as token ids: a prompt and, unless it is to be regenerated, a response.

Sources (see records.py): records of a JSONL file or a local Hugging Face dataset, each
{"prompt": str[, "response": str]}, {"messages": [{"role", "content"}, ...]} or ShareGPT
{"conversations": [{"from", "value"}, ...]}; or a folder of text files, each cut into windows of
prompt + continuation tokens. A chat is rendered with the tokenizer's chat template when it has
one; a final assistant message is the response, and earlier assistant turns are marked in the
prompt, to be trained like the response.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from vllm_dflash.train.chat import (
    assistant_char_spans,
    check_messages,
    sharegpt_messages,
    token_spans,
)
from vllm_dflash.train.records import is_hf_dataset, records


@dataclass
class Example:
    prompt_ids: list[int]
    response_ids: list[int]
    # [start, end) token ranges of earlier assistant turns in prompt_ids.
    prompt_spans: list[tuple[int, int]] = field(default_factory=list)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict]
) -> tuple[list[int], list[tuple[int, int]]]:
    """The messages rendered for generation (chat template, else contents one per line) as
    token ids, and the token spans of their assistant turns."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(m["content"] + "\n" for m in messages)
    char_spans = assistant_char_spans(text, messages)
    if not char_spans:
        return encode(tokenizer, text), []
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("finding assistant turns in a chat needs token offsets, which only fast "
                         "tokenizers give; fix: use the target's tokenizer.json (a fast tokenizer)")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return encoded["input_ids"], token_spans(encoded["offset_mapping"], char_spans)


def chat_messages(record: dict) -> list[dict] | None:
    """The record's chat as messages; None for a prompt/response record."""
    if "messages" in record:
        messages = record["messages"]
    elif "conversations" in record:
        messages = sharegpt_messages(record["conversations"])
    else:
        return None
    check_messages(messages)
    return messages


def record_example(tokenizer: PreTrainedTokenizerBase, record: dict) -> Example:
    messages = chat_messages(record)
    if messages is None:
        if not isinstance(record.get("prompt"), str):
            raise ValueError(f"record with keys {sorted(record)} has no 'prompt' text, "
                             "'messages' or 'conversations'; fix: give each record one of them")
        return Example(encode(tokenizer, record["prompt"]),
                       encode(tokenizer, record.get("response") or ""))
    response = []
    if messages and messages[-1]["role"] == "assistant":
        response = encode(tokenizer, messages[-1]["content"]) + [tokenizer.eos_token_id]
        messages = messages[:-1]
    prompt_ids, spans = chat_prompt(tokenizer, messages)
    return Example(prompt_ids, response, spans)


def text_examples(
    tokenizer: PreTrainedTokenizerBase, folder: Path, prompt_tokens: int, response_tokens: int
) -> Iterator[Example]:
    """Every file under folder cut into [prompt_tokens | response_tokens] windows."""
    window = prompt_tokens + response_tokens
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        ids = encode(tokenizer, path.read_text(encoding="utf-8", errors="replace"))
        for start in range(0, len(ids) - prompt_tokens - 1, window):
            chunk = ids[start : start + window]
            yield Example(chunk[:prompt_tokens], chunk[prompt_tokens:])


def example_stream(
    tokenizer: PreTrainedTokenizerBase, path: Path, prompt_tokens: int, response_tokens: int
) -> Iterator[Callable[[], Example]]:
    """The examples of path in order, each as a function that makes it: a reader tokenizes only
    the examples it keeps (a rank its shard)."""
    if path.is_dir() and not is_hf_dataset(path):
        for example in text_examples(tokenizer, path, prompt_tokens, response_tokens):
            yield lambda example=example: example
        return
    for record in records(path):
        yield partial(record_example, tokenizer, record)


def load_examples(
    tokenizer: PreTrainedTokenizerBase, path: Path, prompt_tokens: int, response_tokens: int
) -> list[Example]:
    """All the examples of a data file or folder (see the module docstring)."""
    return [make() for make in example_stream(tokenizer, path, prompt_tokens, response_tokens)]
