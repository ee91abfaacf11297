"""`vllm-dflash train` on several ranks (gloo, 2 CPU processes): per-rank data shards, one DDP
step equal to a single-process step on the same global batch, and a torchrun run killed
mid-epoch that resumes to the loss curve of a run left alone; a drafter 2 ranks trained serves
through vLLM with method "dflash"."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tests.engines import (
    Pair,
    dflash_llm,
    generate_ids,
    greedy_baseline,
    prompts_of_lengths,
    reference_acceptance,
    spec_metrics,
)
from vllm_dflash.cli import build_parser
from vllm_dflash.tiny import write_random_target
from vllm_dflash.train import data
from vllm_dflash.train.blocks import span_anchors
from vllm_dflash.train.distributed import World, join_world, leave_world
from vllm_dflash.train.trainer import (
    STATE_FILE,
    Trainer,
    config_from_args,
    local_batch_size,
    split_examples,
)

REPO = Path(__file__).resolve().parents[1]
TEXT = (Path(os.__file__).parent / "textwrap.py").read_text()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_random_target(tmp_path_factory.mktemp("target"), num_layers=4, vocab_size=512)


def write_data(path: Path, count: int) -> Path:
    """count prompt/response records of different lengths."""
    records = [
        {"prompt": TEXT[300 * i : 300 * i + 100], "response": TEXT[300 * i + 100 : 300 * i + 180
                                                                   + 10 * i]}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def train_argv(target_dir: Path, data_file: Path, out: Path, *options: str) -> list[str]:
    return ["train", "--target", str(target_dir), "--data", str(data_file), "--out", str(out),
            "--no-regenerate", "--seq-len", "96", "--anchors-per-seq", "6", "--layers", "1",
            "--target-layer-ids", "1,2", "--eval-prompts", "0", *options]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_step(rank: int, port: int, argv: list[str], global_ids: list[list[int]],
             anchors: dict[int, torch.Tensor], out_dir: str) -> None:
    """One rank of a 2-rank world: accumulate its part of the global batch, save the gradients
    (after DDP's all-reduce), apply them, save the weights."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    world, _ = join_world("cpu")
    try:
        trainer = Trainer(config_from_args(build_parser().parse_args(argv)), world)
        held = [global_ids.index(s.token_ids) for s in trainer.sequences]
        local = [j for j, g in enumerate(held) if g in anchors]
        loss, tokens = trainer.accumulate(local, [anchors[held[j]] for j in local])
        grads = {n: p.grad.clone() for n, p in trainer.drafter.named_parameters()}
        trainer.apply_gradients()
        decoder = trainer.target.get_decoder().parameters()
        held_numel = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                         for p in decoder)
        torch.save({"held": held, "loss": loss, "tokens": tokens, "grads": grads,
                    "weights": trainer.drafter.state_dict(), "decoder_numel": held_numel},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        leave_world(world)


@pytest.mark.parametrize("options", [[], ["--online-features", "--fsdp-target"]],
                         ids=["ddp", "ddp-fsdp-target"])
def test_ddp_step_equals_single_process_step(target_dir, tmp_path, options):
    """At the default learning rate: AdamW's first step is about lr * sign(grad), so the
    rounding of a gradient near its eps (summed in another order) moves a weight by up to about
    4e-4 * lr (1.2e-6 at lr 3e-3). With --fsdp-target each rank holds half of the target's
    decoder and computes its sequences' features by gathering it layer by layer; alone, the
    option changes nothing."""
    argv = train_argv(target_dir, write_data(tmp_path / "data.jsonl", 7), tmp_path / "out",
                      "--batch-size", "6", *options)
    single = Trainer(config_from_args(build_parser().parse_args(argv)))
    global_ids = [s.token_ids for s in single.sequences]
    # The global batch: 5 sequences, 3 on rank 0 and 2 on rank 1, one of them without blocks.
    gen = torch.Generator().manual_seed(5)
    anchors = {g: span_anchors(single.sequences[g].spans, 8, 6, gen) for g in range(5)}
    anchors[3] = torch.empty(0, dtype=torch.long)
    loss, tokens = single.accumulate(list(anchors), list(anchors.values()))
    grads = {n: p.grad.clone() for n, p in single.drafter.named_parameters()}
    single.apply_gradients()

    mp.spawn(ddp_step, (free_port(), argv, global_ids, anchors, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["held"] for r in ranks] == [[0, 2, 4, 6], [1, 3, 5]]  # every 2nd record
    whole = sum(p.numel() for p in single.target.get_decoder().parameters())
    shares = [r["decoder_numel"] for r in ranks]
    assert shares == ([whole // 2] * 2 if options else [whole] * 2), (shares, whole)
    for rank in ranks:
        assert rank["tokens"] == tokens == 4 * 6 * 8
        assert rank["loss"] == pytest.approx(loss, rel=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(rank["grads"][name], grad, rtol=1e-5, atol=1e-8,
                                       msg=name)
        for name, weight in single.drafter.state_dict().items():
            torch.testing.assert_close(rank["weights"][name], weight, rtol=0, atol=1e-6,
                                       msg=name)


def test_each_rank_tokenizes_only_its_shard(target_dir, tmp_path, monkeypatch):
    data_file = write_data(tmp_path / "data.jsonl", 9)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    made = []
    monkeypatch.setattr(data, "record_example",
                        lambda tok, record: made.append(record) or data.Example([1], [2]))
    everything = [json.loads(line) for line in data_file.read_text().splitlines()]
    cfg = config_from_args(build_parser().parse_args(
        train_argv(target_dir, data_file, tmp_path / "out", "--eval-prompts", "2")))
    examples, eval_prompts = split_examples(cfg, tokenizer, World(rank=1, size=2))
    # Records 7 and 8 are held out, which is known at the end of the one pass.
    assert made == everything[1::2] and len(examples) == 3
    assert eval_prompts == []  # rank 0 evaluates
    made.clear()
    examples, eval_prompts = split_examples(cfg, tokenizer, World(rank=0, size=2))
    assert made == everything[0::2] + everything[7:]
    assert len(examples) == 4 and len(eval_prompts) == 2


def test_batch_must_split_evenly_over_ranks():
    assert local_batch_size(8, World(rank=1, size=4)) == 2
    with pytest.raises(ValueError, match="--batch-size 6 is not a multiple of the world size 4.*"
                                         "fix: pass a multiple of 4"):
        local_batch_size(6, World(rank=0, size=4))


def torchrun(argv: list[str], **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "vllm_dflash.cli", *argv]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **popen)


def finished(proc: subprocess.Popen) -> str:
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    return out


def descendants(pid: int) -> list[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [c for c, p in parents.items() if p == parent]
        found, frontier = found + children, frontier + children
    return found


def kill_when_saved(proc: subprocess.Popen, state_file: Path, step: int) -> int:
    """SIGKILL torchrun and its workers (each in its own session) once the saved state is at
    `step` or later; returns the step of the state the kill left."""
    while proc.poll() is None:
        if state_file.exists() and torch.load(state_file)["step"] >= step:
            break
        time.sleep(0.01)
    for pid in descendants(proc.pid) + [proc.pid]:
        os.kill(pid, signal.SIGKILL)
    proc.communicate()
    return torch.load(state_file)["step"]


def test_torchrun_resumes_after_a_kill_to_the_same_loss_curve(target_dir, tmp_path):
    data_file = write_data(tmp_path / "data.jsonl", 24)
    # 2 ranks x 1 sequence x 2 accumulated batches: 6 steps an epoch, 12 in all.
    options = ["--batch-size", "2", "--grad-accum", "2", "--epochs", "2", "--save-every", "1"]
    straight_out, killed_out = tmp_path / "straight", tmp_path / "killed"
    log = finished(torchrun(train_argv(target_dir, data_file, straight_out, *options)))
    assert log.splitlines()[0] == "train: world size 2 (DDP over gloo), device cpu"
    straight = torch.load(straight_out / STATE_FILE)
    assert straight["step"] == 12 and len(straight["losses"]) == 12

    proc = torchrun(train_argv(target_dir, data_file, killed_out, *options))
    killed_at = kill_when_saved(proc, killed_out / STATE_FILE, step=2)
    assert 2 <= killed_at < 12, "the run ended before the kill"
    log = finished(torchrun(train_argv(target_dir, data_file, killed_out, *options,
                                       "--resume")))
    assert f"resumed from {killed_out / STATE_FILE} at step {killed_at}" in log
    resumed = torch.load(killed_out / STATE_FILE)
    assert resumed["losses"] == pytest.approx(straight["losses"], rel=1e-6)
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in straight["history"]]
    weights = load_file(killed_out / "model.safetensors")
    for name, weight in load_file(straight_out / "model.safetensors").items():
        torch.testing.assert_close(weights[name], weight, rtol=0, atol=1e-6, msg=name)


def test_fsdp_target_trains_as_a_whole_target_per_rank(target_dir, tmp_path):
    """Uneven shards (3 and 2 sequences accumulated in one step) and an evaluation each epoch:
    the sharded target's ranks run the same forwards (a stand-in where a rank has fewer
    sequences; every rank evaluates), and the losses and acceptance are a whole target's."""
    data_file = write_data(tmp_path / "data.jsonl", 7)
    options = ["--online-features", "--batch-size", "2", "--grad-accum", "3", "--epochs", "2",
               "--eval-prompts", "2"]
    runs = {}
    for name, extra in (("whole", []), ("sharded", ["--fsdp-target"])):
        out = tmp_path / name
        # The later --eval-prompts wins over train_argv's.
        argv = train_argv(target_dir, data_file, out, *options, *extra)
        runs[name] = finished(torchrun(argv)), torch.load(out / STATE_FILE)
    log, state = runs["sharded"]
    assert log.splitlines()[0] == "train: world size 2 (DDP, target FSDP over gloo), device cpu"
    whole = runs["whole"][1]
    assert state["step"] == whole["step"] == 2
    assert state["losses"] == pytest.approx(whole["losses"], rel=1e-5)
    assert [h["acceptance_length"] for h in state["history"]] == [
        h["acceptance_length"] for h in whole["history"]]
    assert all(h["acceptance_length"] is not None for h in state["history"])


def test_a_drafter_two_ranks_trained_serves_losslessly(target_dir, tmp_path):
    """Greedy output through LLM() equals no speculation, and acceptance equals the reference
    package's loop on the same drafter (the checkpoint is read as written)."""
    out = tmp_path / "drafter"
    finished(torchrun(train_argv(target_dir, write_data(tmp_path / "data.jsonl", 12), out,
                                 "--batch-size", "2")))
    pair = Pair(target=target_dir, drafter=out, block_size=8)
    prompts = prompts_of_lengths(target_dir, (5, 17, 40))
    baseline = greedy_baseline(target_dir, prompts, 32)
    llm = dflash_llm(pair, pair.block_size - 1)
    got = generate_ids(llm, prompts, max_tokens=32, ignore_eos=True)
    metrics = spec_metrics(llm)
    del llm
    assert got == baseline
    acceptance = 1 + metrics["accepted"] / metrics["drafts"]
    reference = reference_acceptance(pair, [p["prompt_token_ids"] for p in prompts], 32)
    assert abs(acceptance - reference) <= 0.05, (acceptance, reference)
