"""Chat training data: every assistant turn trained and nothing else, ShareGPT read as messages,
streamed JSONL, local Hugging Face datasets."""

import json
import sys

import pytest
import torch
from transformers import AutoTokenizer

from vllm_dflash.tiny import EOS_TOKEN, write_random_target
from vllm_dflash.train.blocks import block_inputs, span_anchors
from vllm_dflash.train.data import Example, example_stream, load_examples, record_example
from vllm_dflash.train.trainer import sequence

ASSISTANT = ["It returns None.", "g raises ValueError when x is negative.",
             "You are welcome, see you."]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What does f return?"},
    {"role": "assistant", "content": ASSISTANT[0]},
    {"role": "user", "content": "and g?"},
    {"role": "assistant", "content": ASSISTANT[1]},
    {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": ASSISTANT[2]},
]
SHAREGPT = [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
             "value": m["content"]} for m in MESSAGES]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny target's tokenizer; its chat template renders "role: content\\n" turns."""
    target = write_random_target(tmp_path_factory.mktemp("target"), num_layers=4,
                                 vocab_size=512)
    return AutoTokenizer.from_pretrained(target)


def chat_sequence(tokenizer, messages: list[dict]):
    example = record_example(tokenizer, {"messages": messages})
    return sequence(example, example.response_ids, seq_len=10_000)


def test_spans_cover_every_assistant_turn_and_nothing_else(tokenizer):
    seq = chat_sequence(tokenizer, MESSAGES)
    ids = seq.token_ids
    assert len(seq.spans) == 3
    for (start, end), content in zip(seq.spans[:2], ASSISTANT):
        # The content's tokens (a first one may hold the space before it) and the turn's end.
        assert tokenizer.decode(ids[start : end - 1]).lstrip() == content
        assert tokenizer.decode(ids[end - 1 : end]) == "\n"
    start, end = seq.spans[2]  # the final turn, the response: content + eos
    assert tokenizer.decode(ids[start:end]) == ASSISTANT[2] + EOS_TOKEN and end == len(ids)
    outside = [t for i, t in enumerate(ids) if not any(s <= i < e for s, e in seq.spans)]
    rest = ("system: You are terse.\nuser: What does f return?\nassistant:user: and g?\n"
            "assistant:user: thanks\nassistant:")
    assert "".join(tokenizer.decode(outside).split()) == "".join(rest.split())


def test_blocks_and_labels_stay_inside_assistant_turns(tokenizer):
    seq = chat_sequence(tokenizer, MESSAGES)
    gen, block_size, hit = torch.Generator().manual_seed(0), 4, set()
    for _ in range(200):
        anchors = span_anchors(seq.spans, block_size, 3, gen)
        _, positions, labels = block_inputs(torch.tensor(seq.token_ids), anchors, block_size, 1)
        for p in anchors.tolist():
            holding = [k for k, (s, e) in enumerate(seq.spans) if s <= p and p + block_size <= e]
            assert len(holding) == 1, (p, seq.spans)
            hit.update(holding)
        labelled = positions[labels != -100].tolist()
        assert all(any(s <= q < e for s, e in seq.spans) for q in labelled)
    assert hit == {0, 1, 2}  # every assistant turn is trained


def test_chatml_turns_end_with_the_end_of_turn_token(tokenizer):
    chatml = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    chatml.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chatml.chat_template = CHATML
    seq = chat_sequence(chatml, MESSAGES)
    history = [chatml.decode(seq.token_ids[s:e]) for s, e in seq.spans[:2]]
    assert history == [content + "<|im_end|>" for content in ASSISTANT[:2]]


def test_sharegpt_and_messages_give_the_same_tokens(tokenizer, tmp_path):
    assert SHAREGPT[1]["from"] == "human" and SHAREGPT[2]["from"] == "gpt"
    messages, sharegpt = tmp_path / "messages.jsonl", tmp_path / "sharegpt.jsonl"
    messages.write_text(json.dumps({"messages": MESSAGES}) + "\n"
                        + json.dumps({"messages": MESSAGES[:4]}) + "\n")
    sharegpt.write_text(json.dumps({"conversations": SHAREGPT}) + "\n"
                        + json.dumps({"conversations": SHAREGPT[:4]}) + "\n")
    from_messages = load_examples(tokenizer, messages, 8, 8)
    assert load_examples(tokenizer, sharegpt, 8, 8) == from_messages
    assert len(from_messages[0].prompt_spans) == 2 and from_messages[0].response_ids
    assert len(from_messages[1].prompt_spans) == 1 and not from_messages[1].response_ids


def test_a_regenerated_response_keeps_the_earlier_turns():
    example = Example(prompt_ids=list(range(10)), response_ids=[7, 7], prompt_spans=[(3, 6)])
    assert sequence(example, [1, 2, 3, 4], seq_len=100).spans == [(3, 6), (10, 14)]
    assert sequence(example, [1, 2, 3, 4], seq_len=12).spans == [(3, 6), (10, 12)]
    assert sequence(example, [1, 2, 3, 4], seq_len=5).spans == [(3, 5)]


def test_bad_records_name_the_fix(tokenizer):
    with pytest.raises(ValueError, match="from 'bot', which has no chat role; fix: use one of"):
        record_example(tokenizer, {"conversations": [{"from": "bot", "value": "hi"}]})
    with pytest.raises(ValueError, match="no 'prompt' text, 'messages' or 'conversations'"):
        record_example(tokenizer, {"text": "hi"})
    with pytest.raises(TypeError, match="message 0 .user. has content list, not text; fix"):
        record_example(tokenizer, {"messages": [{"role": "user", "content": [{"text": "x"}]}]})


def test_jsonl_is_read_as_a_stream(tokenizer, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "a"}) + "\n\n" + json.dumps({"messages": MESSAGES})
                    + "\n{oops\n")
    stream = example_stream(tokenizer, data, 8, 8)
    assert next(stream)().prompt_ids == tokenizer("a")["input_ids"]
    assert next(stream)().response_ids  # the records before the bad line come out first
    with pytest.raises(ValueError, match="data.jsonl:4: not a JSON record .*fix: one JSON"):
        next(stream)


def test_hf_dataset_without_datasets_names_the_install(tokenizer, tmp_path, monkeypatch):
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    with pytest.raises(ImportError, match="needs the datasets package; fix: pip install datasets"):
        next(example_stream(tokenizer, tmp_path / "saved", 8, 8))


def test_hf_datasets_give_the_jsonl_examples(tokenizer, tmp_path):
    import datasets  # installed with the test tools (scripts/install_cpu.sh)
    records = [{"messages": MESSAGES}, {"messages": MESSAGES[:2]}, {"messages": MESSAGES[:5]}]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    expected = load_examples(tokenizer, jsonl, 8, 8)
    rows = datasets.Dataset.from_list(records)
    rows.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": rows}).save_to_disk(str(tmp_path / "splits"))
    (tmp_path / "snapshot" / "data").mkdir(parents=True)
    rows.to_parquet(str(tmp_path / "snapshot" / "data" / "train-00000.parquet"))
    for path in ["saved", "splits", "snapshot", "snapshot/data/train-00000.parquet"]:
        assert load_examples(tokenizer, tmp_path / path, 8, 8) == expected, path

