"""A drafter given as a Hugging Face hub id ("org/name") loads from its snapshot in the HF cache.

The cache is built here as huggingface_hub lays it out (files in blobs/, symlinked from
snapshots/<commit>/, refs/main naming the commit) and read with HF_HUB_OFFLINE=1, so nothing
is downloaded.
"""

import hashlib
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub.constants
import pytest
import torch
from huggingface_hub import ResolvedRevision

from vllm_dflash.checkpoint import drafter_dir, load_drafter
from vllm_dflash.config import DFlashConfig, DFlashConfigError
from vllm_dflash.tiny import write_random_drafter, write_random_target

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("drafter")
    target = write_random_target(root / "target", num_layers=4)
    write_random_drafter(root / "drafter", target, block_size=8, num_layers=1)
    return root / "drafter"


@pytest.fixture
def hub_cache(tmp_path: Path, drafter: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline HF cache holding `drafter` as "org/name" at main; returns its snapshot dir."""
    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in drafter.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    # huggingface_hub reads both variables once, when it is imported.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_hub_id_resolves_to_the_cached_snapshot(hub_cache: Path, drafter: Path) -> None:
    assert drafter_dir("org/name") == hub_cache
    assert drafter_dir("org/name", revision="main") == hub_cache
    assert drafter_dir("org/name", revision=COMMIT) == hub_cache
    assert DFlashConfig.from_pretrained("org/name") == DFlashConfig.from_pretrained(drafter)
    loaded, want = load_drafter("org/name").state_dict(), load_drafter(drafter).state_dict()
    assert loaded.keys() == want.keys()
    assert all(torch.equal(loaded[key], want[key]) for key in want)


def test_local_directory_is_used_as_is(hub_cache: Path, drafter: Path) -> None:
    assert drafter_dir(drafter) == drafter
    assert drafter_dir(str(drafter)) == drafter


def test_hub_id_absent_offline_names_the_id_and_the_fix(hub_cache: Path) -> None:
    for call in (drafter_dir, DFlashConfig.from_pretrained, load_drafter):
        with pytest.raises(DFlashConfigError, match="'org/other'.*HF_HUB_OFFLINE.*fix"):
            call("org/other")
    with pytest.raises(DFlashConfigError, match="'org/name'.*revision 'v2'.*fix"):
        drafter_dir("org/name", revision="v2")


def test_start_up_check_loads_a_hub_drafter_and_refuses_another_revision(
    hub_cache: Path, drafter: Path
) -> None:
    from vllm_dflash.proposer import validate_speculative_config

    def spec(revision: str | None) -> SimpleNamespace:
        draft = SimpleNamespace(model="org/name", revision=revision, quantization=None)
        return SimpleNamespace(draft_model_config=draft, num_speculative_tokens=7,
                               draft_sample_method="greedy",
                               disable_padded_drafter_batch=False)

    # The tiny target the drafter was made for (write_random_target's defaults).
    target = SimpleNamespace(get_hidden_size=lambda: 256, get_vocab_size=lambda: 1024,
                             hf_text_config=SimpleNamespace(num_hidden_layers=4),
                             dtype=torch.float32, max_model_len=512)
    # vLLM passes the default revision pinned to its commit.
    main = ResolvedRevision(COMMIT, initial=None, repo_id="org/name")
    want = DFlashConfig.from_pretrained(drafter)
    assert validate_speculative_config(spec(main), target) == want
    assert validate_speculative_config(spec(None), target) == want
    # The engine loads a hub drafter's weights at the default revision: another one is refused.
    with pytest.raises(DFlashConfigError, match="revision='v2'.*'org/name'.*not supported.*fix"):
        validate_speculative_config(spec("v2"), target)


def test_a_hub_drafter_is_recognised_by_its_config(hub_cache: Path) -> None:
    # vLLM names the method "dflash" only for ids with "dflash" in them.
    from vllm_dflash.plugin import is_dflash_checkpoint

    assert is_dflash_checkpoint("org/name")
    assert not is_dflash_checkpoint("org/other")  # not in the cache, offline
    assert not is_dflash_checkpoint("not a hub id")
