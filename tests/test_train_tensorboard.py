"""`vllm-dflash train --tensorboard DIR`: the event file holds every scalar at every optimizer
step (read back with tensorboard's EventAccumulator), the values are the trainer's, the
per-position accuracy is the greedy hit rate of each mask position, and a missing tensorboard
package fails at start-up with the install line."""

import sys
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.test_train import train_argv
from vllm_dflash.cli import build_parser, main
from vllm_dflash.tiny import write_random_target
from vllm_dflash.train.blocks import position_hits
from vllm_dflash.train.forward import draft_pass
from vllm_dflash.train.tensorboard_log import (
    ACCEPTANCE_LENGTH,
    LOSS,
    LR,
    TOKENS_PER_S,
    accuracy_tag,
)
from vllm_dflash.train.trainer import Trainer, config_from_args, lr_lambda


@dataclass
class Run:
    trainer: Trainer
    events: EventAccumulator
    last_accuracy: list[float]  # the trainer's step_accuracy after its last step


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    """Two epochs of a tiny drafter, logged to tensorboard."""
    tmp = tmp_path_factory.mktemp("tensorboard")
    target_dir = write_random_target(tmp / "target", num_layers=4, vocab_size=512)
    argv = train_argv(target_dir, tmp, epochs=2) + ["--tensorboard", str(tmp / "tb")]
    trainer = Trainer(config_from_args(build_parser().parse_args(argv)))
    trainer.run()
    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()
    return Run(trainer, events, list(trainer.step_accuracy))


def scalars(events: EventAccumulator, tag: str) -> tuple[list[int], list[float]]:
    points = events.Scalars(tag)
    return [p.step for p in points], [p.value for p in points]


def test_every_scalar_at_every_optimizer_step(run):
    trainer, B = run.trainer, run.trainer.cfg.block_size
    per_step = [LOSS, LR, TOKENS_PER_S] + [accuracy_tag(k) for k in range(1, B)]
    assert sorted(run.events.Tags()["scalars"]) == sorted(per_step + [ACCEPTANCE_LENGTH])
    for tag in per_step:
        assert scalars(run.events, tag)[0] == list(range(1, trainer.total_steps + 1)), tag
    steps, taus = scalars(run.events, ACCEPTANCE_LENGTH)
    assert len(trainer.history) == 2 and steps == [h["step"] for h in trainer.history]
    assert taus == pytest.approx([h["acceptance_length"] for h in trainer.history], abs=5e-4)


def test_values_are_the_trainers(run):
    trainer = run.trainer
    assert scalars(run.events, LOSS)[1] == pytest.approx(trainer.losses, rel=1e-6)
    factor = lr_lambda(trainer.total_steps, trainer.cfg.warmup)
    lrs = [trainer.cfg.lr * factor(step) for step in range(trainer.total_steps)]
    assert scalars(run.events, LR)[1] == pytest.approx(lrs, rel=1e-6)  # each step's own lr
    assert all(value > 0 for value in scalars(run.events, TOKENS_PER_S)[1])
    last = [scalars(run.events, accuracy_tag(k))[1][-1] for k in range(1, len(run.last_accuracy)
                                                                         + 1)]
    assert last == pytest.approx(run.last_accuracy, rel=1e-6)


def greedy_drafts(trainer: Trainer, features: torch.Tensor, anchor: int, p: int) -> list[int]:
    """The B-1 greedy tokens of the block anchored at p, drafted alone (not packed with other
    blocks, no block_inputs or block_mask)."""
    B, mask_id = trainer.cfg.block_size, trainer.drafter.cfg.mask_token_id
    block = torch.tensor([anchor] + [mask_id] * (B - 1))
    with torch.no_grad():
        logits = draft_pass(trainer.drafter, features[:p], block, torch.arange(p, p + B),
                            torch.ones(B, p + B, dtype=torch.bool), *trainer.frozen)[1]
    return logits[1:].argmax(dim=-1).tolist()


def test_position_accuracy_is_each_mask_positions_greedy_hit_rate(run, monkeypatch):
    """A batch whose labels are planted from each block's greedy drafts: in the j-th block,
    positions k <= 1 + j % (B-1) hold the draft and the others another token, so that the
    accuracy falls with k. The labels are not inputs of their block, and the blocks lie 2B
    apart, so no label is another block's anchor."""
    trainer = run.trainer
    B, vocab = trainer.cfg.block_size, trainer.drafter.cfg.vocab_size
    indices, sequences, anchors, blocks = trainer.batch(0), list(trainer.sequences), [], 0
    for i in indices:
        ids, features = list(sequences[i].token_ids), trainer.features_of([i])[0]
        start, end = sequences[i].spans[-1]
        block_anchors = list(range(max(start, 1), end - B + 1, 2 * B))
        for p in block_anchors:
            for k, draft in enumerate(greedy_drafts(trainer, features, ids[p], p), start=1):
                ids[p + k] = draft if k <= 1 + blocks % (B - 1) else (draft + 1) % vocab
            blocks += 1
        sequences[i] = replace(sequences[i], token_ids=ids)
        anchors.append(torch.tensor(block_anchors))
    monkeypatch.setattr(trainer, "sequences", sequences)
    trainer.accumulate(indices, anchors)
    assert blocks >= B - 1
    expected = [sum(k <= 1 + j % (B - 1) for j in range(blocks)) / blocks for k in range(1, B)]
    assert trainer.step_accuracy == expected  # counts over blocks: exact


def test_position_hits_counts_per_mask_position():
    greedy = torch.tensor([0, 1, 0, 3, 0, 4, 4, 1])  # two blocks of 4
    labels = torch.tensor([-100, 1, 2, 3, -100, 4, 5, 0])
    hits = position_hits(F.one_hot(greedy, 6).float(), labels, block_size=4)
    assert hits.tolist() == [2.0, 0.0, 1.0]


def test_missing_tensorboard_fails_at_start_with_the_install_line(tmp_path, monkeypatch):
    """Before anything is read: the target and the data do not even exist."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    argv = ["train", "--target", str(tmp_path / "no-target"), "--data",
            str(tmp_path / "no-data.jsonl"), "--out", str(tmp_path / "out"), "--no-regenerate",
            "--tensorboard", str(tmp_path / "tb")]
    with pytest.raises(ImportError, match="tensorboard package.*fix: pip install tensorboard"):
        main(argv)
    assert not (tmp_path / "tb").exists()
