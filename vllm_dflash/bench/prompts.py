"""The benchmark's prompts: a JSONL file of {"prompt": "..."} lines."""

import json
from itertools import cycle, islice
from pathlib import Path


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    prompts = [json.loads(line)["prompt"] for line in lines][:limit]
    if not prompts:
        raise ValueError(f"no prompts in {path}: expected JSONL lines of {{\"prompt\": \"...\"}}")
    return prompts


def requests_for(prompts: list[str], concurrency: int) -> list[str]:
    """Every prompt once, repeated in order until there are at least `concurrency` requests."""
    return list(islice(cycle(prompts), max(len(prompts), concurrency)))
