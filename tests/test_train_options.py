"""`vllm-dflash train` options: --grad-accum, --online-features, --autocast bf16, and the
--regen-tp / --regen-dp engines of regeneration (stand-in engines: no vLLM starts here)."""

import json
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_dflash.cli import build_parser
from vllm_dflash.tiny import write_random_target
from vllm_dflash.train import regenerate as regen
from vllm_dflash.train import trainer as trainer_module
from vllm_dflash.train.regenerate import regenerate, settings_of
from vllm_dflash.train.trainer import TrainConfig, Trainer, config_from_args

TEXT = (Path(os.__file__).parent / "textwrap.py").read_text()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_random_target(tmp_path_factory.mktemp("target"), num_layers=4, vocab_size=512)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """8 prompt/response records of different lengths."""
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    path.write_text("".join(
        json.dumps({"prompt": TEXT[400 * i : 400 * i + 120],
                    "response": TEXT[400 * i + 120 : 400 * i + 260 + 15 * i]}) + "\n"
        for i in range(8)
    ))
    return path


def trainer(target_dir: Path, data_file: Path, *options: str) -> Trainer:
    argv = ["train", "--target", str(target_dir), "--data", str(data_file), "--out", "unused",
            "--no-regenerate", "--seq-len", "96", "--anchors-per-seq", "8",
            "--target-layer-ids", "1,2", "--eval-prompts", "0", "--lr", "3e-3", *options]
    return Trainer(config_from_args(build_parser().parse_args(argv)))


def train_steps(t: Trainer, steps: int) -> list[float]:
    return [t.train_step(step)[0] for step in range(steps)]


def test_grad_accum_and_online_features_give_the_batch_of_their_product(target_dir, data_file,
                                                                        monkeypatch):
    whole = trainer(target_dir, data_file, "--batch-size", "4")
    accumulated = trainer(target_dir, data_file, "--batch-size", "2", "--grad-accum", "2")
    online = trainer(target_dir, data_file, "--batch-size", "2", "--grad-accum", "2",
                     "--online-features")
    assert whole.steps_per_epoch == accumulated.steps_per_epoch == 2
    assert online.features is None
    forwards = []
    features = trainer_module.batch_context_features
    monkeypatch.setattr(trainer_module, "batch_context_features",
                        lambda model, seqs, ids: forwards.append(len(seqs)) or features(model,
                                                                                        seqs, ids))
    losses = [train_steps(t, 3) for t in (whole, accumulated, online)]
    assert forwards == [2, 2] * 3  # one target forward per batch, two batches a step
    assert losses[1] == losses[0]
    assert losses[2] == pytest.approx(losses[0], rel=1e-5)
    for name, weight in whole.drafter.state_dict().items():
        torch.testing.assert_close(accumulated.drafter.state_dict()[name], weight, rtol=0, atol=0)
        torch.testing.assert_close(online.drafter.state_dict()[name], weight, rtol=0, atol=1e-5)


def test_bf16_autocast_keeps_fp32_master_weights(target_dir, data_file):
    fp32 = trainer(target_dir, data_file)
    bf16 = trainer(target_dir, data_file, "--autocast", "bf16")
    indices = [0, 1, 2, 3]
    anchors = [torch.tensor([40, 50, 60]) for _ in indices]
    exact, autocast = fp32.accumulate(indices, anchors)[0], bf16.accumulate(indices, anchors)[0]
    assert autocast != exact and autocast == pytest.approx(exact, rel=2e-2)
    for param in bf16.drafter.parameters():
        assert param.dtype == param.grad.dtype == torch.float32
    bf16.apply_gradients()
    state = bf16.optimizer.state_dict()["state"]
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.float32}
    assert {p.dtype for p in bf16.drafter.parameters()} == {torch.float32}


def test_frozen_embedding_and_lm_head_are_not_copied_where_they_need_not_be(
        target_dir, data_file, tmp_path):
    # A bf16 target under bf16 autocast: the loss reads its own weights, with the same result as
    # fp32 copies of them (autocast casts those back to bf16 for every matmul).
    own = trainer(target_dir, data_file, "--dtype", "bfloat16", "--autocast", "bf16")
    embed = own.target.get_input_embeddings().weight
    assert own.frozen[0] is embed and own.frozen[1] is own.target.get_output_embeddings().weight
    copies = trainer(target_dir, data_file, "--dtype", "bfloat16", "--autocast", "bf16")
    copies.model.frozen = copies.frozen = tuple(w.float() for w in copies.frozen)
    indices, anchors = [0, 1, 2, 3], [torch.tensor([40, 50, 60])] * 4
    assert own.accumulate(indices, anchors)[0] == pytest.approx(
        copies.accumulate(indices, anchors)[0], rel=1e-6)
    for name, param in own.drafter.named_parameters():
        torch.testing.assert_close(param.grad, copies.drafter.get_parameter(name).grad,
                                   rtol=1e-5, atol=1e-7, msg=name)
    # A tied target: one fp32 copy serves both.
    tied = write_random_target(tmp_path / "tied", num_layers=4, vocab_size=512,
                               tie_word_embeddings=True)
    t = trainer(tied, data_file, "--dtype", "bfloat16")
    assert t.frozen[0] is t.frozen[1] and t.frozen[0].dtype == torch.float32


def test_bf16_autocast_trains(target_dir, data_file):
    t = trainer(target_dir, data_file, "--autocast", "bf16", "--batch-size", "2")
    losses = train_steps(t, 16)
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.2, losses


def test_option_errors_name_the_fix():
    with pytest.raises(ValueError, match="--autocast 'fp16' is unknown; fix: pass one of none, "
                                         "bf16"):
        TrainConfig(target="", data="", out="", autocast="fp16")
    with pytest.raises(ValueError, match="--grad-accum 0 must be >= 1; fix"):
        TrainConfig(target="", data="", out="", grad_accum=0)


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]


def stand_in_engines(monkeypatch) -> list[tuple]:
    """Engines, run one after the other here, that answer each prompt with its reversal."""
    calls = []

    def engine(target, prompts, max_tokens, temperature, seed, device, out_file, batch_size,
               gpus=None, tensor_parallel_size=1):
        calls.append((prompts, Path(out_file).name, gpus, tensor_parallel_size))
        with open(out_file, "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"prompt_ids": p, "response_ids": p[::-1]}) + "\n"
                         for p in prompts)

    monkeypatch.setattr(regen, "_generate", engine)
    monkeypatch.setattr(regen, "_in_children",
                        lambda function, calls: [function(*args) for args in calls])
    return calls


def test_regen_dp_splits_the_prompts_over_engines_and_merges(tmp_path, monkeypatch):
    calls = stand_in_engines(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    out = tmp_path / "responses.jsonl"
    responses = regenerate("t", PROMPTS, 8, device="cuda", out_file=out,
                           tensor_parallel_size=2, data_parallel_size=2)
    assert responses == [p[::-1] for p in PROMPTS]
    assert calls == [(PROMPTS[0::2], "responses.jsonl.dp0", "4,5", 2),
                     (PROMPTS[1::2], "responses.jsonl.dp1", "6,7", 2)]
    assert not list(tmp_path.glob("*.dp*")) and len(out.read_text().splitlines()) == 6


def test_regen_dp_resumes_from_a_killed_runs_parts(tmp_path, monkeypatch):
    calls = stand_in_engines(monkeypatch)
    out = tmp_path / "responses.jsonl"
    settings = json.dumps({"settings": settings_of("t", 8, 0.0, 0)})
    planted = json.dumps({"prompt_ids": PROMPTS[1], "response_ids": [99]})
    Path(f"{out}.dp1").write_text(settings + "\n" + planted + "\n" + planted[:9])
    responses = regenerate("t", PROMPTS, 8, out_file=out, data_parallel_size=2)
    assert responses[1] == [99]  # kept from the killed run, not generated again
    assert [prompts for prompts, *_ in calls] == [[PROMPTS[0], PROMPTS[3]],
                                                  [PROMPTS[2], PROMPTS[4]]]
    assert [gpus for _, _, gpus, _ in calls] == [None, None]  # CPU engines


def test_regen_dp_needs_the_gpus(tmp_path, monkeypatch):
    stand_in_engines(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match="--regen-dp 2 x --regen-tp 2 needs 4 GPUs, 2 are "
                                         "visible; fix"):
        regenerate("t", PROMPTS, 8, device="cuda", out_file=tmp_path / "r.jsonl",
                   tensor_parallel_size=2, data_parallel_size=2)


def test_engine_gets_its_gpus_and_tensor_parallel_size(tmp_path, monkeypatch):
    """_generate with a stand-in vllm module: what it passes to LLM() and where it runs."""
    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs, gpus=os.environ["CUDA_VISIBLE_DEVICES"])

        def generate(self, prompts, params, use_tqdm):
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=p["ids"][::-1])])
                    for p in prompts]

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, lambda **kwargs: kwargs
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    for key, value in {**regen.CPU_ENV, "CUDA_VISIBLE_DEVICES": "0"}.items():
        monkeypatch.setenv(key, value)  # restored after the test
    out = tmp_path / "part.jsonl"
    regen._generate("t", PROMPTS[:3], 8, 0.0, 0, "cuda", str(out), 2, gpus="2,3",
                    tensor_parallel_size=2)
    assert seen["tensor_parallel_size"] == 2 and seen["gpus"] == "2,3"
    assert [json.loads(line)["response_ids"] for line in out.read_text().splitlines()] == [
        p[::-1] for p in PROMPTS[:3]]


def test_options_reach_the_config():
    argv = ["train", "--target", "t", "--data", "d", "--out", "o", "--autocast", "bf16",
            "--grad-accum", "3", "--online-features", "--regen-tp", "2", "--regen-dp", "4"]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert (cfg.autocast, cfg.grad_accum, cfg.online_features, cfg.regen_tp, cfg.regen_dp) == (
        "bf16", 3, True, 2, 4)
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv[:6], "--autocast", "fp16"])


def test_init_from_target_starts_the_drafter_as_the_layer_after_the_deepest_feature(
        target_dir, data_file):
    t = trainer(target_dir, data_file, "--init-from-target", "--layers", "1")
    target_layer = t.target.get_decoder().layers[3]  # features 1, 2: the next layer is 3
    for name, param in t.drafter.layers[0].named_parameters():
        torch.testing.assert_close(param, target_layer.get_parameter(name), rtol=0, atol=0)
    # Context states: exactly what target layer 3 normalises before its k_proj and v_proj.
    ids = torch.tensor([t.sequences[0].token_ids])
    hidden = t.target(input_ids=ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[2][0], hidden[3][0]], dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(t.drafter.fuse(features),
                                   target_layer.input_layernorm(hidden[3][0]))
    # And it trains from there.
    losses = train_steps(t, 8)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    with pytest.raises(ValueError, match=r"copies target layers 3..4 .* fix: pass "
                                         r"--target-layer-ids whose largest id is at most 1"):
        trainer(target_dir, data_file, "--init-from-target", "--layers", "2")


def test_from_drafter_trains_a_saved_drafter_further(target_dir, data_file, tmp_path):
    from vllm_dflash.checkpoint import save_drafter

    first = trainer(target_dir, data_file)
    train_steps(first, 4)
    save_drafter(first.drafter, tmp_path / "saved")
    again = trainer(target_dir, data_file, "--from-drafter", str(tmp_path / "saved"))
    for name, param in again.drafter.named_parameters():
        torch.testing.assert_close(param, first.drafter.get_parameter(name), rtol=0, atol=0,
                                   msg=name)
    with pytest.raises(ValueError, match=r"other shapes than these options give: num_layers 1 "
                                         r"\(options: 2\).*fix: pass the --layers"):
        trainer(target_dir, data_file, "--from-drafter", str(tmp_path / "saved"), "--layers", "2")
    with pytest.raises(ValueError, match="--init-from-target and --from-drafter"):
        trainer(target_dir, data_file, "--from-drafter", "x", "--init-from-target")
