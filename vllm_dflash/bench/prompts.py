"""The benchmark's prompts: a JSONL file of {"prompt": "..."} lines, or of chats
({"messages": [...]}) rendered with the target's chat template (--chat)."""

import json
from itertools import cycle, islice
from pathlib import Path


def load_prompts(path: str | Path, limit: int | None = None,
                 chat_target: str | None = None) -> list[str]:
    """The prompts of path's first `limit` lines. With chat_target, each line's "messages"
    (or its "prompt" as one user turn) rendered for generation with that target's chat
    template, as a chat client's request reaches the model."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines][:limit]
    if not records:
        raise ValueError(f"no prompts in {path}: expected JSONL lines of {{\"prompt\": \"...\"}}")
    if chat_target is None:
        return [record["prompt"] for record in records]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_target)
    if not tokenizer.chat_template:
        raise ValueError(f"--chat: the target {chat_target} has no chat template; fix: drop "
                         "--chat and give rendered prompts, or use a target with one")
    return [tokenizer.apply_chat_template(
        record.get("messages") or [{"role": "user", "content": record["prompt"]}],
        tokenize=False, add_generation_prompt=True) for record in records]


def requests_for(prompts: list[str], concurrency: int) -> list[str]:
    """Every prompt once, repeated in order until there are at least `concurrency` requests."""
    return list(islice(cycle(prompts), max(len(prompts), concurrency)))
