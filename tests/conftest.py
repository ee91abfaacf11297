"""Shared fixtures. Those of tests/engines.py import it inside, so that modules without engines
do not get its environment settings."""

import os
from collections.abc import Callable

# The README runs the suite on two pytest-xdist workers, one per core of the 2-core machine
# kind. Each keeps to one thread: two workers that each run two threads of OpenMP or BLAS on
# two cores spend their time waiting for each other. (vLLM's CPU engines in the test process
# already serve on one thread.)
XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if XDIST_WORKER:  # before torch and numpy load their thread pools
    for threads_env in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(threads_env, "1")

import pytest
import torch

from vllm_dflash.config import DFlashConfig

if XDIST_WORKER:  # in case a plugin loaded torch before this file
    torch.set_num_threads(1)

# The modules that take longest (engines in processes of their own, interpreted Triton), in
# about that order: run first, so that the two workers (`--dist loadfile`: a module's tests
# stay on one worker, with its module-scoped engines) finish together.
SLOWEST_MODULES = (
    "test_model_runner_v2.py", "test_triton_engine.py", "test_smollm2_pair.py",
    "test_tensor_parallel.py", "test_data_parallel.py", "test_bench.py",
    "test_target_families.py", "test_installed_not_asked.py", "test_train_distributed.py",
    "test_drafter_dtypes.py", "test_serve.py", "test_reliability.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOWEST_MODULES.index(name) if name in SLOWEST_MODULES else len(SLOWEST_MODULES)

    items.sort(key=rank)  # stable: each module keeps its own order


@pytest.fixture
def make_config() -> Callable[..., DFlashConfig]:
    """Factory for a small drafter config; keyword arguments override fields."""

    def make(**overrides: object) -> DFlashConfig:
        num_layers = int(overrides.get("num_layers", 2))
        fields = {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_layers": num_layers,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 64,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 1024,
            "vocab_size": 512,
            "layer_types": ["full_attention"] * num_layers,
            "sliding_window": None,
            "block_size": 8,
            "mask_token_id": 1,
            "target_layer_ids": [2, 5],
            "num_target_layers": 8,
        }
        return DFlashConfig(**(fields | overrides))

    return make


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    """A random-weight target and drafter (tests/engines.make_pair), one per module."""
    from tests.engines import make_pair

    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def trained_pair():
    """The committed trained pair (tests/fixtures/pair): its drafts are really accepted."""
    from tests.engines import TRAINED

    return TRAINED


@pytest.fixture(scope="module")
def useless_pair(tmp_path_factory):
    """The trained target with a random one-layer drafter: its drafts are almost never
    accepted."""
    from tests.engines import TRAINED, Pair
    from vllm_dflash.tiny import write_random_drafter

    drafter = tmp_path_factory.mktemp("random") / "drafter"
    write_random_drafter(drafter, TRAINED.target, block_size=8, num_layers=1)
    return Pair(TRAINED.target, drafter, 8)


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    """All of the trained pair's held-out prompts; a module that needs others defines its own
    `prompts`."""
    from tests.engines import heldout_prompts

    return heldout_prompts()
