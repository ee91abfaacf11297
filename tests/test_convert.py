"""`vllm-dflash convert` and `vllm-dflash train --save-format speculators`: z-lab ->
speculators -> z-lab keeps the config and every tensor, a speculators copy drafts the same
logits, what cannot be converted fails naming the fix."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_train import train_argv
from vllm_dflash.checkpoint import load_drafter, read_config
from vllm_dflash.cli import build_parser, main
from vllm_dflash.config import lilicorr_fields
from vllm_dflash.speculators import is_speculators_config
from vllm_dflash.tiny import write_random_drafter, write_random_target
from vllm_dflash.train.blocks import block_inputs, block_mask
from vllm_dflash.train.forward import draft_pass
from vllm_dflash.train.trainer import config_from_args

HEADS = {
    "dflash": None,
    "dflash2": {"conv_kernel_size": 2, "conv_group_size": 32, "selector_rank": 8,
                "selector_top_k": 4},
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_random_target(tmp_path_factory.mktemp("target"), num_layers=4, vocab_size=512)


@pytest.fixture(scope="module", params=list(HEADS))
def zlab(request, target_dir, tmp_path_factory) -> Path:
    """A random one-layer drafter in the z-lab schema."""
    out = tmp_path_factory.mktemp(request.param) / "z-lab"
    write_random_drafter(out, target_dir, num_layers=1, target_layer_ids=[1, 2],
                         head=HEADS[request.param])
    return out


def convert(src: Path, dst: Path, schema: str, *options: str) -> None:
    main(["convert", str(src), str(dst), "--to", schema, *options])


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_round_trip_keeps_the_config_and_every_tensor(zlab, target_dir, tmp_path):
    speculators, back = tmp_path / "speculators", tmp_path / "back"
    convert(zlab, speculators, "speculators", "--verifier", str(target_dir))
    convert(speculators, back, "z-lab")
    written = config_of(speculators)
    assert is_speculators_config(written) and not is_speculators_config(config_of(zlab))
    assert written["speculators_config"]["verifier"] == {
        "name_or_path": str(target_dir), "architectures": ["Qwen3ForCausalLM"]}
    assert config_of(back) == config_of(zlab)
    assert read_config(speculators) == read_config(back) == read_config(zlab)
    original = load_file(zlab / "model.safetensors")
    for path in (speculators, back):
        tensors = load_file(path / "model.safetensors")
        assert sorted(tensors) == sorted(original)
        assert all(torch.equal(tensors[key], value) and tensors[key].dtype == value.dtype
                   for key, value in original.items())
        assert load_drafter(path).cfg == read_config(zlab)


def test_speculators_copy_drafts_the_same_logits(zlab, tmp_path):
    convert(zlab, tmp_path / "speculators", "speculators")
    original, copy = load_drafter(zlab), load_drafter(tmp_path / "speculators")
    cfg, gen = original.cfg, torch.Generator().manual_seed(0)
    context, B = 24, cfg.block_size
    features = torch.randn(context, len(cfg.target_layer_ids) * cfg.hidden_size, generator=gen)
    tables = [torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) for _ in range(2)]
    anchors = torch.tensor([5, 13])
    ids = torch.randint(0, cfg.vocab_size, (context + B,), generator=gen)
    block_ids, positions, _ = block_inputs(ids, anchors, B, cfg.mask_token_id)
    mask = block_mask(anchors, B, context)
    with torch.no_grad():
        want, got = (draft_pass(d, features, block_ids, positions, mask, *tables)[1]
                     for d in (original, copy))
    assert torch.equal(got, want)


def test_convert_refuses_a_dst_that_holds_a_checkpoint(zlab):
    with pytest.raises(SystemExit, match="already holds a checkpoint.*fix: pass a new or empty"):
        convert(zlab, zlab, "speculators")
    assert not is_speculators_config(config_of(zlab))


def test_a_lilicorr_drafter_has_no_speculators_form(target_dir, tmp_path):
    lilicorr = tmp_path / "lilicorr"
    write_random_drafter(lilicorr, target_dir, num_layers=1, target_layer_ids=[1, 2],
                         head=lilicorr_fields([4, 1, 2, 8], hidden_size=256))
    with pytest.raises(SystemExit, match="LiLiCorr drafter has no speculators form; fix: "):
        convert(lilicorr, tmp_path / "out", "speculators")
    assert not (tmp_path / "out").exists()


def test_train_saves_the_speculators_schema(target_dir, tmp_path):
    main(train_argv(target_dir, tmp_path, epochs=1)
         + ["--eval-prompts", "0", "--save-format", "speculators"])
    out = tmp_path / "drafter"
    assert config_of(out)["speculators_model_type"] == "dflash"
    assert config_of(out)["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    drafter = load_drafter(out)
    assert drafter.cfg.block_size == 8 and drafter.cfg.target_layer_ids == [1, 2]
    trained, saved = torch.load(out / "trainer_state.pt")["drafter"], drafter.state_dict()
    assert sorted(saved) == sorted(trained)
    assert all(torch.equal(saved[key], value.to(torch.bfloat16))  # --save-dtype's default
               for key, value in trained.items())


def test_train_refuses_a_lilicorr_drafter_in_the_speculators_schema(target_dir, tmp_path):
    argv = train_argv(target_dir, tmp_path, epochs=1) + [
        "--save-format", "speculators", "--lilicorr", "4,1,2,8"]
    with pytest.raises(ValueError, match="speculators schema cannot hold a LiLiCorr.*fix: "):
        config_from_args(build_parser().parse_args(argv))
