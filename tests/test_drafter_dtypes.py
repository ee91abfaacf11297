"""bf16 and fp16 engines (target and drafter in that dtype, as a user on a CPU with AVX512-BF16
or on a GPU runs them) on the committed trained pair: greedy output equals the same-dtype
engine's without speculation, and the drafter is accepted about as well as in fp32.

bf16 rounds the target's and the drafter's activations to 8 bits of mantissa (fp16 to 11),
which flips near-tied drafts and target tokens alike, so acceptance matches the fp32 reference
loosely (TOLERANCE); a drafter fed the wrong context, layer or position in bf16 would fall far below it
(tests/test_vllm_e2e.py, scripts/mutation_check.py)."""

from functools import partial

import pytest
import torch

from tests.engines import (
    TRAINED,
    acceptance_of,
    dflash_llm,
    generate_ids,
    greedy_baseline,
    heldout_ids,
    own_loop_acceptance,
)

MAX_NEW_TOKENS = 48
K = TRAINED.block_size - 1
TOLERANCE = 0.3
# Only the drafts' logits rounded: a near-tied draft may flip, nothing else changes.
BF16_HEAD_TOLERANCE = 0.1


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    return heldout_ids()


def lossless_acceptance(probe, want_probe: str, prompt_ids: list[list[int]],
                        dtype: str = "float32") -> float:
    """An engine of the trained pair in dtype: probe(worker) gives want_probe, greedy output
    equals the same-dtype engine's without speculation; returns its acceptance length."""
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    want = greedy_baseline(TRAINED.target, prompts, MAX_NEW_TOKENS, dtype=dtype)
    llm = dflash_llm(TRAINED, K, dtype=dtype)
    try:
        assert llm.collective_rpc(probe) == [want_probe]
        got, acceptance = acceptance_of(llm, partial(generate_ids, llm, prompts,
                                                     max_tokens=MAX_NEW_TOKENS, ignore_eos=True))
    finally:
        del llm
    assert got == want
    return acceptance


def drafter_dtype_and_head(worker) -> str:
    runner = worker.model_runner.drafter.draft_runner
    own_head = runner.logits == worker.model_runner.model.compute_logits
    return f"{runner.drafter.fc.weight.dtype}, the target's own head: {own_head}"


def draft_logits_dtype(worker) -> str:
    runner = worker.model_runner.drafter.draft_runner
    return str(runner.logits(torch.zeros(2, runner.cfg.hidden_size)).dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_engine_is_lossless_and_accepted_as_fp32(prompt_ids, dtype, monkeypatch):
    from vllm_dflash.vllm.config import DRAFT_HEAD_ENV

    # A bf16 target's own head is already the bf16 draft head asked for: no copy of it.
    monkeypatch.setenv(DRAFT_HEAD_ENV, "bfloat16" if dtype == "bfloat16" else "target")
    acceptance = lossless_acceptance(drafter_dtype_and_head,
                                     f"torch.{dtype}, the target's own head: True", prompt_ids,
                                     dtype)
    reference = own_loop_acceptance(TRAINED, prompt_ids, MAX_NEW_TOKENS, K)
    assert abs(acceptance - reference) <= TOLERANCE, (acceptance, reference)


def test_bf16_draft_head_of_an_fp32_target_is_lossless_and_accepted_as_fp32(prompt_ids,
                                                                            monkeypatch):
    """VLLM_DFLASH_DRAFT_HEAD=bfloat16: the drafts' logits through a bf16 copy of the fp32
    target's lm_head (the target verifies with its own)."""
    from vllm_dflash.vllm.config import DRAFT_HEAD_ENV

    monkeypatch.setenv(DRAFT_HEAD_ENV, "bfloat16")
    acceptance = lossless_acceptance(draft_logits_dtype, "torch.bfloat16", prompt_ids)
    reference = own_loop_acceptance(TRAINED, prompt_ids, MAX_NEW_TOKENS, K)
    assert abs(acceptance - reference) <= BF16_HEAD_TOLERANCE, (acceptance, reference)
