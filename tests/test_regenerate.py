"""Resumable regeneration (vllm_dflash/train/regenerate.py): batches appended to a JSONL file,
prompts already there skipped. Two vLLM engine starts in all: the one-batch reference and the
resumed run."""

import json
from pathlib import Path

import pytest
import torch

from tests.engines import TRAINED
from vllm_dflash.cli import build_parser, main
from vllm_dflash.train import regenerate as regen
from vllm_dflash.train.regenerate import read_responses, regenerate, settings_of
from vllm_dflash.train.trainer import (
    config_from_args,
    responses_file,
    split_examples,
    training_sequences,
)

TARGET = str(TRAINED.target)
MAX_TOKENS = 8
# The first prompt comes twice: generated once, answered twice.
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 12], [40, 41, 42, 43, 44], [5, 6, 7, 8], [300, 9]]


def line(record: dict) -> str:
    return json.dumps(record)


def fake_generate(calls: list[list[list[int]]]):
    """A stand-in for the vLLM child: answers each prompt with its reversed ids."""

    def run(function, target, prompts, max_tokens, temperature, seed, device, out_file, batch):
        calls.append(prompts)
        with open(out_file, "a", encoding="utf-8") as f:
            f.writelines(line({"prompt_ids": p, "response_ids": p[::-1][:max_tokens]}) + "\n"
                         for p in prompts)

    return run


def no_engine(*args) -> None:
    raise AssertionError("vLLM started although every prompt has its response")


@pytest.fixture(scope="module")
def one_batch() -> list[list[int]]:
    """All the prompts in one vLLM generate."""
    pytest.importorskip("vllm")
    return regenerate(TARGET, PROMPTS, MAX_TOKENS, batch_size=len(PROMPTS))


def test_one_batch_is_the_targets_greedy_output(one_batch):
    from vllm_dflash.train.features import load_target

    target = load_target(TARGET, torch.float32, "cpu")
    for prompt, response in zip(PROMPTS, one_batch):
        greedy = target.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                 do_sample=False)
        assert response == greedy[0, len(prompt) :].tolist()


def test_resume_generates_only_the_missing_prompts(one_batch, tmp_path, monkeypatch):
    out = tmp_path / "responses.jsonl"
    planted = [1, 2, 3]  # not the target's answer: stays only if its prompt is skipped
    kept = [
        line({"settings": settings_of(TARGET, MAX_TOKENS, 0.0, 0)}),
        line({"prompt_ids": PROMPTS[0], "response_ids": planted}),
        line({"prompt_ids": PROMPTS[1], "response_ids": one_batch[1]}),
    ]
    cut = line({"prompt_ids": PROMPTS[2], "response_ids": one_batch[2]})[:-5]
    out.write_text("\n".join(kept) + "\n" + cut, encoding="utf-8")

    responses = regenerate(TARGET, PROMPTS, MAX_TOKENS, out_file=out, batch_size=2)

    assert responses == [planted] + one_batch[1:4] + [planted, one_batch[5]]
    lines = out.read_text(encoding="utf-8").splitlines()
    assert lines[:3] == kept
    new = [json.loads(text) for text in lines[3:]]
    assert [r["prompt_ids"] for r in new] == [PROMPTS[2], PROMPTS[3], PROMPTS[5]]
    assert [r["response_ids"] for r in new] == [one_batch[2], one_batch[3], one_batch[5]]

    monkeypatch.setattr(regen, "_in_child", no_engine)
    assert regenerate(TARGET, PROMPTS[::-1], MAX_TOKENS, out_file=out) == responses[::-1]


def test_partial_settings_line_is_rewritten(tmp_path, monkeypatch):
    out = tmp_path / "responses.jsonl"
    out.write_text('{"settings": {"tar', encoding="utf-8")
    calls = []
    monkeypatch.setattr(regen, "_in_child", fake_generate(calls))
    assert regenerate(TARGET, PROMPTS[:2], MAX_TOKENS, out_file=out) == [p[::-1] for p in
                                                                         PROMPTS[:2]]
    assert calls == [PROMPTS[:2]]
    assert json.loads(out.read_text().splitlines()[0])["settings"]["max_tokens"] == MAX_TOKENS


def test_other_settings_or_a_malformed_line_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(regen, "_in_child", no_engine)
    out = tmp_path / "responses.jsonl"
    settings = settings_of(TARGET, MAX_TOKENS, 0.0, 0)
    out.write_text(line({"settings": settings}) + "\n")
    with pytest.raises(ValueError, match="not .*fix: use the same settings"):
        regenerate(TARGET, PROMPTS, MAX_TOKENS + 1, out_file=out)
    out.write_text(line({"settings": settings}) + "\n{oops}\n" + line({"prompt_ids": []}))
    with pytest.raises(ValueError, match=":2: not a response record"):
        read_responses(out, settings)


def regenerate_argv(tmp_path: Path, *options: str) -> list[str]:
    data = tmp_path / "data.jsonl"
    texts = ["def f(x):", "import os", "class A:", "for i in range(3):"]
    data.write_text("".join(line({"prompt": t}) + "\n" for t in texts))
    return ["train", "--target", TARGET, "--data", str(data), "--out", str(tmp_path / "out"),
            "--max-response-tokens", str(MAX_TOKENS), "--eval-prompts", "1", *options]


def test_regenerate_only_then_training_reads_the_file(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(regen, "_in_child", fake_generate(calls))
    argv = regenerate_argv(tmp_path, "--cache-dir", str(tmp_path / "cache"))
    main(argv + ["--regenerate-only", "--regenerate-batch-size", "2"])
    printed = capsys.readouterr().out
    stats = json.loads(printed[printed.index("{\n") :])
    cfg = config_from_args(build_parser().parse_args(argv))
    assert len(calls) == 1 and len(calls[0]) == 3
    assert stats["prompts"] == 3 and stats["responses_file"] == str(responses_file(cfg))

    monkeypatch.setattr(regen, "_in_child", no_engine)
    from transformers import AutoTokenizer

    examples, _ = split_examples(cfg, AutoTokenizer.from_pretrained(TARGET))
    sequences = training_sequences(cfg, examples)
    assert [s.token_ids for s in sequences] == [p + p[::-1] for p in calls[0]]
    assert len(read_responses(responses_file(cfg))) == 3


def test_regenerate_only_needs_a_cache_dir(tmp_path):
    with pytest.raises(ValueError, match="--cache-dir"):
        main(regenerate_argv(tmp_path, "--regenerate-only"))
