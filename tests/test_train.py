"""Training: packed block mask, anchors, loss weights, data, the greedy eval loop, a smoke run."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from vllm_dflash.checkpoint import load_drafter
from vllm_dflash.cli import build_parser
from vllm_dflash.model import SelectorInputs
from vllm_dflash.model import block_mask as inference_mask
from vllm_dflash.tiny import MASK_TOKEN, random_drafter, write_random_target
from vllm_dflash.train.blocks import (
    block_inputs,
    block_loss,
    block_mask,
    default_gamma,
    lattice_loss,
    loss_weights,
    sample_anchors,
    selector_loss,
)
from vllm_dflash.train.data import load_examples
from vllm_dflash.train.evaluate import speculative_greedy
from vllm_dflash.train.features import context_features, load_target, target_features
from vllm_dflash.train.forward import draft_pass
from vllm_dflash.train.trainer import TrainConfig, Trainer, config_from_args, drafter_config

TEXT = (Path(os.__file__).parent / "textwrap.py").read_text()
DFLASH2 = [2, 32, 8, 4]  # taps, channels per group, selector rank, candidates
LILICORR = [4, 1, 2, 8]  # candidates, lattice layers, heads, factor dimension


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_random_target(tmp_path_factory.mktemp("target"), num_layers=4, vocab_size=512)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(str(target_dir), torch.float32, "cpu")


@pytest.fixture(scope="module")
def drafter(target_dir, target):
    cfg = TrainConfig(target=str(target_dir), data="", out="", layers=2, target_layer_ids=[1, 2])
    mask_id = target.config.vocab_size - 1
    return random_drafter(drafter_config(cfg, target, mask_id), seed=1)


def test_block_mask_sees_own_block_and_context_before_anchor():
    anchors, B, ctx = torch.tensor([3, 5, 11]), 4, 16
    mask = block_mask(anchors, B, ctx)
    assert mask.shape == (3 * B, ctx + 3 * B)
    for q in range(3 * B):
        a = q // B
        assert mask[q, :ctx].tolist() == [j < anchors[a] for j in range(ctx)]
        own = [ctx + a * B + i for i in range(B)]  # bidirectional inside the block
        assert mask[q, ctx:].nonzero().flatten().add(ctx).tolist() == own


def test_block_mask_rows_equal_inference_mask():
    anchors, B = torch.tensor([2, 7]), 4
    mask = block_mask(anchors, B, 12)
    for a, p in enumerate(anchors.tolist()):
        rows = mask[a * B : (a + 1) * B]
        expected = inference_mask(p, B, causal=False, window=None)
        assert rows[:, :p].equal(expected[:, :p]) and not rows[:, p:12].any()
        assert rows[:, 12 + a * B : 12 + (a + 1) * B].equal(expected[:, p:])


def test_packed_blocks_equal_one_block_at_a_time(drafter, target):
    """One packed forward of many blocks = separate forwards with context = features < anchor."""
    L, B = 40, drafter.cfg.block_size
    ids = torch.randint(0, 500, (L,))
    features = torch.randn(L, 2 * drafter.cfg.hidden_size)
    weights = (target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    anchors = torch.tensor([5, 9, 20, 31])
    block_ids, positions, _ = block_inputs(ids, anchors, B, drafter.cfg.mask_token_id)
    packed = draft_pass(
        drafter, features, block_ids, positions, block_mask(anchors, B, L), *weights
    )[1]
    for a, p in enumerate(anchors.tolist()):
        one = slice(a * B, (a + 1) * B)
        alone = draft_pass(
            drafter,
            features[:p],
            block_ids[one],
            positions[one],
            torch.ones(B, p + B, dtype=torch.bool),
            *weights,
        )[1]
        torch.testing.assert_close(packed[one], alone, atol=1e-5, rtol=1e-4)


def test_context_features_are_the_full_passes(target):
    """Training's decoder-only features equal those of the full pass the eval loop runs."""
    ids = torch.randint(2, 500, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    features, _ = target_features(target, ids, [0, 2])
    assert features.shape == (37, 2 * target.config.hidden_size)
    assert torch.equal(context_features(target, ids, [0, 2]), features)


def test_block_inputs():
    ids = torch.arange(100, 120)
    block_ids, positions, labels = block_inputs(ids, torch.tensor([2, 10]), 4, mask_token_id=7)
    assert positions.tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    assert block_ids.tolist() == [102, 7, 7, 7, 110, 7, 7, 7]
    assert labels.tolist() == [-100, 103, 104, 105, -100, 111, 112, 113]


def test_sample_anchors_in_response_and_distinct():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        anchors = sample_anchors(
            response_start=30, seq_len=100, block_size=8, num_anchors=16, gen=gen
        )
        assert len(anchors) == 16 and len(set(anchors.tolist())) == 16
        assert anchors.equal(anchors.sort().values)
        assert anchors.min() >= 30 and anchors.max() + 8 <= 100
    every = sample_anchors(30, 40, 8, num_anchors=99, gen=gen)
    assert every.tolist() == list(range(30, 33))
    assert len(sample_anchors(30, 36, 8, 4, gen)) == 0
    assert sample_anchors(0, 9, 8, 4, gen).tolist() == [1]  # an anchor needs some context


def test_loss_weights():
    assert [default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    w = loss_weights(8, 4.0)
    assert w.shape == (7,) and w[0] == 1.0
    torch.testing.assert_close(w, torch.tensor([math.exp(-k / 4) for k in range(7)]))


def test_block_loss_is_weighted_ce_of_mask_positions():
    logits, B = torch.randn(8, 11), 4
    labels = torch.tensor([-100, 1, 2, 3, -100, 4, 5, 6])
    w = loss_weights(B, 2.0)
    ce = torch.nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    weights = torch.cat([torch.zeros(1), w]).repeat(2)
    torch.testing.assert_close(block_loss(logits, labels, w), (ce * weights).sum() / weights.sum())


def test_load_examples(target_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    jsonl = tmp_path / "data.jsonl"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    jsonl.write_text(
        json.dumps({"prompt": "def f():", "response": " pass"})
        + "\n"
        + json.dumps({"messages": messages})
        + "\n"
    )
    plain, chat = load_examples(tok, jsonl, 8, 8)
    assert tok.decode(plain.prompt_ids) == "def f():" and tok.decode(plain.response_ids) == " pass"
    assert tok.decode(chat.prompt_ids) == "user: hi\nassistant: "
    assert chat.response_ids == tok("ok")["input_ids"] + [tok.eos_token_id]
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text(TEXT[:3000])
    windows = load_examples(tok, tmp_path / "texts", 16, 48)
    assert len(windows) > 2 and all(len(w.prompt_ids) == 16 for w in windows)
    joined = [t for w in windows for t in w.prompt_ids + w.response_ids]
    assert joined == tok(TEXT[:3000])["input_ids"][: len(joined)]  # a tail without response goes


@pytest.fixture(scope="module")
def dflash2_drafter(target_dir, target):
    cfg = TrainConfig(target=str(target_dir), data="", out="", layers=2, target_layer_ids=[1, 2],
                      dflash2=DFLASH2)
    return random_drafter(drafter_config(cfg, target, target.config.vocab_size - 1), seed=1)


@pytest.fixture(scope="module")
def lilicorr_drafter(target_dir, target):
    cfg = TrainConfig(target=str(target_dir), data="", out="", layers=2, target_layer_ids=[1, 2],
                      lilicorr=LILICORR)
    drafter = random_drafter(drafter_config(cfg, target, target.config.vocab_size - 1), seed=1)
    with torch.no_grad():  # a head that matters: its edges overrule the logits' order
        for param in drafter.lilicorr.parameters():
            param.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
    return drafter


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "lilicorr"])
def test_speculative_greedy_equals_greedy_decoding(kind, drafter, dflash2_drafter,
                                                   lilicorr_drafter, target):
    drafter = {"dflash": drafter, "dflash2": dflash2_drafter, "lilicorr": lilicorr_drafter}[kind]
    prompt = torch.randint(2, 500, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    ids, lengths = speculative_greedy(drafter, target, prompt, max_new_tokens=20)
    reference = target.generate(
        torch.tensor([prompt]),
        max_new_tokens=len(ids) - len(prompt),
        do_sample=False,
        eos_token_id=None,
    )[0].tolist()
    assert ids == reference and sum(lengths) == len(ids) - len(prompt) - 1


def train_argv(target_dir: Path, tmp_path: Path, epochs: int) -> list[str]:
    data = tmp_path / "data.jsonl"
    step = 500
    records = [
        {"prompt": TEXT[i : i + 150], "response": TEXT[i + 150 : i + step]}
        for i in range(0, 10 * step, step)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return [
        "train",
        "--target",
        str(target_dir),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "drafter"),
        "--no-regenerate",
        "--epochs",
        str(epochs),
        "--lr",
        "3e-3",
        "--batch-size",
        "2",
        "--seq-len",
        "160",
        "--anchors-per-seq",
        "12",
        "--layers",
        "1",
        "--target-layer-ids",
        "1,2",
        "--eval-prompts",
        "1",
        "--eval-max-new-tokens",
        "8",
    ]


def tokenizer_mask_id(target_dir: Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir).convert_tokens_to_ids(MASK_TOKEN)


def train_and_load(target_dir: Path, tmp_path: Path, *options: str):
    """Trains 4 epochs with the options; the loss falls; returns the config and the checkpoint."""
    argv = train_argv(target_dir, tmp_path, epochs=4) + list(options)
    cfg = config_from_args(build_parser().parse_args(argv))
    stats = Trainer(cfg).run()
    losses = [h["loss"] for h in stats["history"]]
    assert losses[-1] < losses[0] - 0.2, losses
    return cfg, load_drafter(cfg.out, torch.float32)


def test_train_smoke_loss_falls_and_checkpoint_loads(target_dir, tmp_path):
    from dflash.model import DFlashDraftModel

    cfg, drafter = train_and_load(target_dir, tmp_path)
    assert drafter.cfg.block_size == 8 and drafter.cfg.target_layer_ids == [1, 2]
    assert drafter.cfg.mask_token_id == tokenizer_mask_id(target_dir)
    reference, info = DFlashDraftModel.from_pretrained(cfg.out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert reference.target_layer_ids == [1, 2] and reference.block_size == 8


def test_resume_continues_exactly(target_dir, tmp_path):
    argv = train_argv(target_dir, tmp_path, epochs=2) + ["--eval-prompts", "0"]
    cfg = config_from_args(build_parser().parse_args(argv))
    straight = Trainer(cfg)
    straight.run()
    interrupted = Trainer(cfg)
    for step in range(3):
        interrupted.train_step(step)
    interrupted.step = 3
    interrupted.save_state()
    cfg.resume = True
    resumed = Trainer(cfg)
    assert resumed.step == 3
    resumed.run()
    resumed_state = resumed.drafter.state_dict()
    for name, value in straight.drafter.state_dict().items():
        torch.testing.assert_close(value, resumed_state[name], msg=name)


def test_regenerate_is_the_targets_greedy_output(target_dir, target):
    pytest.importorskip("vllm")
    from vllm_dflash.train.regenerate import regenerate

    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    responses = regenerate(str(target_dir), prompts, max_tokens=10)
    for prompt, response in zip(prompts, responses):
        greedy = target.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
        assert response == greedy[0, len(prompt) :].tolist()


def test_training_without_responses_fails_clearly(target_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": TEXT[:200]}) + "\n")
    argv = ["train", "--target", str(target_dir), "--data", str(data), "--out", str(tmp_path)]
    cfg = config_from_args(build_parser().parse_args(argv + ["--no-regenerate"]))
    with pytest.raises(ValueError, match="no training sequence has a response"):
        Trainer(cfg)


def test_selector_loss_is_teacher_forced_ce_over_candidates(dflash2_drafter):
    selector = dflash2_drafter.candidate_selector
    B, H, V = 4, dflash2_drafter.cfg.hidden_size, 512
    gen = torch.Generator().manual_seed(0)
    hidden, logits = torch.randn(2 * B, H, generator=gen), torch.randn(2 * B, V, generator=gen)
    block_ids = torch.tensor([11, 1, 1, 1, 22, 1, 1, 1])
    labels = torch.tensor([-100, 5, 6, 7, -100, 8, 9, 10])
    logits[1, 5] = 50.0  # the first position's truth is a candidate; the others are not
    weights = loss_weights(B, 2.0)
    loss = selector_loss(selector, hidden, logits, block_ids, labels, weights)
    terms, previous = [], {1: 11, 2: 5, 3: 6, 5: 22, 6: 8, 7: 9}
    for row, prev in previous.items():
        truth = int(labels[row])
        candidates = logits[row].topk(selector.top_k).indices
        if truth not in candidates.tolist():
            candidates[-1] = truth
        scores = selector.scores(hidden[row], torch.tensor([prev]), candidates,
                                 logits[row, candidates])[0]
        ce = torch.nn.functional.cross_entropy(scores, (candidates == truth).int().argmax())
        terms.append(weights[row % B - 1] * ce)
    torch.testing.assert_close(loss, torch.stack(terms).sum() / (2 * weights.sum()))


def test_train_dflash2_loss_falls_and_checkpoint_loads(target_dir, tmp_path):
    from dflash.model import DFlash2DraftModel

    cfg, drafter = train_and_load(target_dir, tmp_path, "--dflash2", "2,32,8,4")
    assert drafter.cfg.is_dflash2 and drafter.cfg.selector_top_k == 4
    reference, info = DFlash2DraftModel.from_pretrained(cfg.out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch.testing.assert_close(reference.candidate_selector.predecessor_codebook.weight.float(),
                               drafter.candidate_selector.predecessor_codebook)


def test_lattice_loss_is_teacher_forced_ce_over_each_blocks_lattice(lilicorr_drafter):
    head = lilicorr_drafter.lilicorr
    B, H, V = 4, lilicorr_drafter.cfg.hidden_size, 512
    gen = torch.Generator().manual_seed(0)
    hidden, logits = torch.randn(2 * B, H, generator=gen), torch.randn(2 * B, V, generator=gen)
    labels = torch.tensor([-100, 5, 6, 7, -100, 8, 9, 10])
    logits[1, 5] = 50.0  # the first position's truth is a candidate; the others are not
    table = torch.randn(V, H, generator=gen)
    inputs = SelectorInputs(torch.tensor([11, 22]), torch.randn(2, H, generator=gen),
                            lambda ids: table[ids])
    weights = loss_weights(B, 2.0)
    loss = lattice_loss(head, hidden, logits, labels, weights, inputs)
    terms = []
    for block in range(2):
        rows = range(block * B + 1, block * B + B)
        candidates, log_probs = [], []
        for row in rows:
            lp = logits[row].log_softmax(dim=-1)
            top = lp.topk(head.top_k).indices
            if int(labels[row]) not in top.tolist():
                top[-1] = labels[row]
            candidates.append(top)
            log_probs.append(lp[top])
        one = SelectorInputs(inputs.anchors[block:block + 1],
                             inputs.anchor_states[block:block + 1], inputs.embed)
        scores = head.scores(hidden[list(rows)][None], torch.stack(candidates)[None],
                             torch.stack(log_probs)[None], one)[0]
        previous = 0  # the anchor's row
        for p, row in enumerate(rows):
            truth = int((candidates[p] == labels[row]).int().argmax())
            ce = torch.nn.functional.cross_entropy(scores[p, previous], torch.tensor(truth))
            terms.append(weights[p] * ce)
            previous = truth
    torch.testing.assert_close(loss, torch.stack(terms).sum() / (2 * weights.sum()))


def test_train_lilicorr_loss_falls_and_checkpoint_loads(target_dir, tmp_path):
    _, drafter = train_and_load(target_dir, tmp_path, "--lilicorr", "4,1,2,8")
    assert drafter.cfg.architecture == "LiLiCorrDraftModel"
    assert drafter.cfg.lilicorr.candidate_topk == 4 and drafter.cfg.lilicorr.num_layers == 1


def test_head_options(target_dir, tmp_path):
    argv = train_argv(target_dir, tmp_path, 1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv + ["--lilicorr", "4,1"])
    both = build_parser().parse_args(argv + ["--lilicorr", "4,1,2,8", "--dflash2", "2,32,8,4"])
    with pytest.raises(ValueError, match="--dflash2 and --lilicorr.*fix: pass one"):
        config_from_args(both)


def test_dflash2_option_takes_four_numbers(target_dir, tmp_path):
    with pytest.raises(SystemExit):
        build_parser().parse_args(train_argv(target_dir, tmp_path, 1) + ["--dflash2", "2,32"])
