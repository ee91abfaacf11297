"""A drafter given as a Hugging Face hub id ("org/name") loads from its snapshot in the HF cache.

The cache is built here as huggingface_hub lays it out (files in blobs/, symlinked from
snapshots/<commit>/, refs/main naming the commit) and read with HF_HUB_OFFLINE=1, so nothing
is downloaded.
"""

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub.constants
import pytest
import torch
from huggingface_hub import ResolvedRevision

from tests.engines import speculative_config_stub
from vllm_dflash.checkpoint import drafter_dir, load_config, load_drafter
from vllm_dflash.config import DFlashConfigError
from vllm_dflash.tiny import write_random_drafter, write_random_target

COMMIT = "0123456789abcdef0123456789abcdef01234567"
COMMIT_V2 = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("drafter")
    target = write_random_target(root / "target", num_layers=4)
    write_random_drafter(root / "drafter", target, block_size=8, num_layers=1)
    return root / "drafter"


@pytest.fixture(scope="module")
def drafter_v2(drafter: Path) -> Path:
    """Another drafter for the same target: block size 4."""
    root = drafter.parent
    write_random_drafter(root / "drafter_v2", root / "target", block_size=4, num_layers=1)
    return root / "drafter_v2"


def _add_snapshot(repo: Path, commit: str, ref: str, files: Path) -> Path:
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in files.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, drafter: Path, drafter_v2: Path,
              monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline HF cache holding `drafter` as "org/name" at main and `drafter_v2` at the tag
    v2; returns main's snapshot dir."""
    repo = tmp_path / "models--org--name"
    snapshot = _add_snapshot(repo, COMMIT, "main", drafter)
    _add_snapshot(repo, COMMIT_V2, "v2", drafter_v2)
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
    assert load_config("org/name") == load_config(drafter)
    loaded, want = load_drafter("org/name").state_dict(), load_drafter(drafter).state_dict()
    assert loaded.keys() == want.keys()
    assert all(torch.equal(loaded[key], want[key]) for key in want)


def test_local_directory_is_used_as_is(hub_cache: Path, drafter: Path) -> None:
    assert drafter_dir(drafter) == drafter
    assert drafter_dir(str(drafter)) == drafter


def test_hub_id_absent_offline_names_the_id_and_the_fix(hub_cache: Path) -> None:
    for call in (drafter_dir, load_config, load_drafter):
        with pytest.raises(DFlashConfigError, match="'org/other'.*HF_HUB_OFFLINE.*fix"):
            call("org/other")
    with pytest.raises(DFlashConfigError, match="'org/name'.*revision 'v3'.*fix"):
        drafter_dir("org/name", revision="v3")


def test_start_up_check_and_engine_load_the_revision_asked_for(
    hub_cache: Path, drafter: Path, drafter_v2: Path
) -> None:
    from vllm_dflash.vllm.config import drafter_path, validate_speculative_config

    def spec(revision: str | None, k: int = 7) -> SimpleNamespace:
        return speculative_config_stub("org/name", k, revision)

    # The tiny target the drafter was made for (write_random_target's defaults).
    target = SimpleNamespace(get_hidden_size=lambda: 256, get_vocab_size=lambda: 1024,
                             hf_text_config=SimpleNamespace(num_hidden_layers=4),
                             dtype=torch.float32, max_model_len=512)
    # vLLM passes the default revision pinned to its commit.
    main = ResolvedRevision(COMMIT, initial=None, repo_id="org/name")
    want = load_config(drafter)
    assert validate_speculative_config(spec(main), target) == want
    assert validate_speculative_config(spec(None), target) == want
    v2 = ResolvedRevision(COMMIT_V2, initial="v2", repo_id="org/name")
    for revision in ("v2", COMMIT_V2, v2):
        assert validate_speculative_config(spec(revision, k=3), target).block_size == 4
        assert drafter_path(spec(revision).draft_model_config) == hub_cache.parent / COMMIT_V2
    # The config of the revision asked for is checked: 7 drafts do not fit v2's block of 4.
    with pytest.raises(DFlashConfigError, match="num_speculative_tokens"):
        validate_speculative_config(spec("v2"), target)


def test_a_hub_drafter_is_recognised_by_its_config(hub_cache: Path) -> None:
    # vLLM names the method "dflash" only for ids with "dflash" in them.
    from vllm_dflash.vllm.config import is_dflash_checkpoint

    assert is_dflash_checkpoint("org/name")
    assert not is_dflash_checkpoint("org/other")  # not in the cache, offline
    assert not is_dflash_checkpoint("not a hub id")


HUB_ENGINE_SCRIPT = """
import sys
from vllm import LLM, SamplingParams

def llm(revision, k):
    spec = {"method": "dflash", "model": "org/name", "num_speculative_tokens": k,
            "revision": revision}
    return LLM(sys.argv[1], speculative_config=spec, enforce_eager=True, max_model_len=256,
               dtype="float32")

engine = llm("v2", 3)
out = engine.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=8))
print("GENERATED", len(out[0].outputs[0].token_ids))
del engine
try:
    llm("v2", 7)
except Exception as error:
    print("REFUSED", error)
"""


def test_llm_runs_a_hub_drafter_at_a_revision(hub_cache: Path, drafter: Path) -> None:
    """Through vllm.LLM, offline: the v2 tag's drafter (block size 4) runs, and its config is
    the one checked in the caller's process (7 drafts refused, before any engine starts)."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache.parents[2]), "HF_HUB_OFFLINE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [sys.executable, "-c", HUB_ENGINE_SCRIPT, str(drafter.parent / "target")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                            check=False)
    log = result.stdout + result.stderr
    assert "GENERATED 8" in result.stdout, log[-4000:]
    assert "block_size=4, num_speculative_tokens=3" in log, log[-4000:]
    assert "REFUSED" in result.stdout and "must be in [1, 3]" in result.stdout, log[-4000:]
