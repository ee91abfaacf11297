"""Tests for vllm_dflash.kernels.verify: exactness (greedy), losslessness (chi-square), seeds,
Triton == reference (TRITON_INTERPRET=1, in a subprocess), and the vLLM adapter."""

import itertools
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.chi_square import assert_distribution, chi_square, critical
from vllm_dflash.kernels.inputs import cu_num_draft_tokens, verify_batch
from vllm_dflash.kernels.verify import (
    draw_randoms,
    greedy_walk_torch,
    rejection_walk_reference,
    rejection_walk_triton,
    sampling_probs,
    verify,
    verify_reference,
    verify_triton,
    vllm_rejection_sample,
)

REPO = Path(__file__).resolve().parents[1]
NUM_SAMPLES = 100_000


def _sample(probs: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, n, replacement=True, generator=generator)


# --------------------------------------------------------------------------- greedy


def test_greedy_is_plain_argmax_decoding() -> None:
    torch.manual_seed(0)
    vocab = 10
    counts = [3, 0, 4, 1, 2, 4, 0, 2]
    matching = [1, 0, 4, 0, 2, 2, 0, 2]  # drafts agreeing with the argmax before the first miss
    target_probs = torch.randn(sum(counts), vocab).softmax(dim=-1)
    argmax = target_probs.argmax(dim=-1)
    bonus = torch.arange(len(counts)) + 100
    drafts, expected, row = [], [], 0
    for n, k in zip(counts, matching, strict=True):
        rows = argmax[row : row + n].tolist()
        wrong = [(a + 1) % vocab for a in rows]
        drafts += rows[:k] + wrong[k:]
        expected.append(rows[: k + 1] if k < n else rows + [bonus[len(expected)].item()])
        row += n
    drafts[-1] = -1  # vLLM's padding id where the argmax was: rejected, corrected to it
    expected[-1] = expected[-1][:2]
    max_spec_len = max(counts)
    expected_out = torch.full((len(counts), max_spec_len + 1), -1, dtype=torch.int32)
    for b, tokens in enumerate(expected):
        expected_out[b, : len(tokens)] = torch.tensor(tokens)

    is_greedy = torch.ones(len(counts), dtype=torch.bool)
    for generators in ({}, {0: torch.Generator().manual_seed(1)}):
        out = verify_reference(torch.tensor(drafts), cu_num_draft_tokens(counts), max_spec_len,
                               None, target_probs, bonus, is_greedy, generators)
        assert torch.equal(out, expected_out)
    assert torch.equal(verify(torch.tensor(drafts), cu_num_draft_tokens(counts), max_spec_len,
                              None, target_probs, bonus, is_greedy, {}), expected_out)


# --------------------------------------------------------------------------- losslessness


def _first_token_batch(p: torch.Tensor, q: torch.Tensor, probabilistic: bool):
    """B = NUM_SAMPLES single-draft requests with target p, drafts sampled from q."""
    gen = torch.Generator().manual_seed(1234)
    drafts = _sample(q, NUM_SAMPLES, gen)
    target = p.expand(NUM_SAMPLES, -1).contiguous()
    draft_probs = q.expand(NUM_SAMPLES, -1).contiguous() if probabilistic else None
    torch.manual_seed(5678)
    out = verify_reference(drafts, torch.arange(1, NUM_SAMPLES + 1, dtype=torch.int32), 1,
                           draft_probs, target, torch.full((NUM_SAMPLES,), -7),
                           torch.zeros(NUM_SAMPLES, dtype=torch.bool), {})
    return drafts, out


P = torch.tensor([0.10, 0.30, 0.10, 0.20, 0.20, 0.10])
Q = torch.tensor([0.50, 0.30, 0.20, 0.00, 0.00, 0.00])


@pytest.mark.parametrize("probabilistic", [False, True], ids=["one-hot", "draft-probs"])
def test_first_token_follows_target(probabilistic: bool) -> None:
    drafts, out = _first_token_batch(P, Q, probabilistic)
    assert_distribution(out[:, 0].long(), P)
    stat, df = chi_square(torch.bincount(drafts[drafts < 3], minlength=6), P)
    assert stat > 100 * critical(df), "the test cannot tell the draft distribution from p"
    assert ((out[:, 1] == -7) == (out[:, 0] == drafts)).all()  # bonus exactly on acceptance


@pytest.mark.parametrize("probabilistic", [False, True], ids=["one-hot", "draft-probs"])
def test_first_token_follows_top_k_top_p_target(probabilistic: bool) -> None:
    logits = torch.tensor([[1.5, -0.3, 0.9, 0.0, 1.2, -1.0]])
    p = sampling_probs(logits, torch.tensor([0.8]), torch.tensor([4]), torch.tensor([0.85]))[0]
    assert (p == 0).sum() == 3  # top-k drops two tokens, top-p one more
    q = torch.softmax(torch.tensor([0.0, 1.0, 0.5, 0.2, -0.5, 1.0]), dim=0)
    _, out = _first_token_batch(p, q, probabilistic)
    assert_distribution(out[:, 0].long(), p)


@pytest.mark.parametrize("probabilistic", [False, True], ids=["one-hot", "draft-probs"])
def test_second_token_given_first_accepted(probabilistic: bool) -> None:
    """Two drafts; the target at position 2 depends on token 1 (P2[d1]). Given the first output
    equals d1, the second output must follow P2[d1], and the first output must follow p1."""
    gen = torch.Generator().manual_seed(99)
    vocab = 6
    p1 = torch.softmax(torch.randn(vocab, generator=gen), dim=0)
    q1 = torch.softmax(torch.randn(vocab, generator=gen), dim=0)
    p2_table = torch.softmax(2 * torch.randn(vocab, vocab, generator=gen), dim=1)
    q2_table = torch.softmax(torch.randn(vocab, vocab, generator=gen), dim=1)
    d1 = _sample(q1, NUM_SAMPLES, gen)
    d2 = torch.multinomial(q2_table[d1], 1, generator=gen)[:, 0]
    drafts = torch.stack([d1, d2], dim=1).reshape(-1)
    target = torch.stack([p1.expand(NUM_SAMPLES, -1), p2_table[d1]], dim=1).reshape(-1, vocab)
    draft_probs = torch.stack([q1.expand(NUM_SAMPLES, -1), q2_table[d1]], dim=1).reshape(-1, vocab)
    torch.manual_seed(7)
    out = verify_reference(drafts, torch.arange(2, 2 * NUM_SAMPLES + 1, 2, dtype=torch.int32), 2,
                           draft_probs if probabilistic else None, target,
                           torch.full((NUM_SAMPLES,), -7),
                           torch.zeros(NUM_SAMPLES, dtype=torch.bool), {})
    assert_distribution(out[:, 0].long(), p1)
    continued = out[:, 0].long() == d1
    counts = torch.zeros(vocab, vocab, dtype=torch.long)
    counts.index_put_((d1[continued], out[continued, 1].long()),
                      torch.ones(int(continued.sum()), dtype=torch.long), accumulate=True)
    stat, df = chi_square(counts, p2_table)
    assert df == vocab * (vocab - 1)
    assert stat < critical(df), f"chi-square {stat:.1f} (df {df})"


def test_sampling_probs_definition() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(4, 1)
    probs = sampling_probs(logits, torch.tensor([1.0, 2.0, 1.0, 0.0]),
                           torch.tensor([0, 0, 3, 0]), torch.tensor([1.0, 1.0, 1.0, 0.7]))
    full = logits[0].softmax(dim=0)
    assert full[0] < 0.7 < full[0] + full[1]  # top-p 0.7 keeps exactly tokens 0 and 1
    expected = torch.zeros(4, 6)
    expected[0] = full
    expected[1] = (logits[0] / 2).softmax(dim=0)
    expected[2, :3] = logits[0, :3].softmax(dim=0)
    expected[3, :2] = logits[0, :2].softmax(dim=0)
    torch.testing.assert_close(probs, expected)


# --------------------------------------------------------------------------- block verification


def _markov_world(seed: int, vocab: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Target p and drafter q as first-order chains: row x is the next-token distribution after
    token x, row `vocab` the first token's."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(vocab + 1, vocab, generator=gen), dim=1)
    q = torch.softmax(torch.randn(vocab + 1, vocab, generator=gen), dim=1)
    return p, q


def _generate(p: torch.Tensor, q: torch.Tensor, length: int, k: int, block: bool,
              probabilistic: bool = True) -> tuple[torch.Tensor, torch.Tensor, float]:
    """NUM_SAMPLES sequences generated by speculative decoding: each step drafts k tokens from
    the drafter chain q (its argmax when not probabilistic) and verifies them against p. Returns
    the first `length` tokens, the first step's drafts and the mean drafts kept per step."""
    vocab, n = p.shape[1], NUM_SAMPLES
    gen = torch.Generator().manual_seed(4321)
    torch.manual_seed(8765)
    tokens = torch.full((n, length + k + 1), -1, dtype=torch.long)
    lengths = torch.zeros(n, dtype=torch.long)
    last = torch.full((n,), vocab)
    kept, steps, first_drafts = 0, 0, None
    while (lengths < length).any():
        contexts, drafts = [last], []
        for _ in range(k):
            after = q[contexts[-1]]
            drafts.append(torch.multinomial(after, 1, generator=gen)[:, 0] if probabilistic
                          else after.argmax(dim=1))
            contexts.append(drafts[-1])
        drafts = torch.stack(drafts, dim=1)
        first_drafts = drafts if first_drafts is None else first_drafts
        target = torch.stack([p[c] for c in contexts[:k]], dim=1).reshape(-1, vocab)
        draft_probs = torch.stack([q[c] for c in contexts[:k]], dim=1).reshape(-1, vocab)
        bonus = torch.multinomial(p[contexts[k]], 1, generator=gen)[:, 0]
        out = verify_reference(drafts.reshape(-1), cu_num_draft_tokens([k] * n), k,
                               draft_probs if probabilistic else None, target, bonus,
                               torch.zeros(n, dtype=torch.bool), {}, block=block).long()
        count = (out >= 0).sum(dim=1)
        columns = lengths[:, None] + torch.arange(k + 1)
        emitted = (out >= 0) & (columns < tokens.shape[1])
        tokens[torch.arange(n)[:, None].expand_as(columns)[emitted], columns[emitted]] = out[emitted]
        lengths += count
        last = out.gather(1, (count - 1)[:, None])[:, 0]
        kept, steps = kept + (count - 1).sum().item(), steps + 1
    return tokens[:, :length], first_drafts, kept / (steps * n)


def _joint(p: torch.Tensor, length: int) -> torch.Tensor:
    """Probability of every token sequence of that length under the chain p, [V ** length]."""
    vocab = p.shape[1]
    probs = p[vocab]
    for _ in range(length - 1):
        probs = (probs[:, None] * p[:vocab][torch.arange(probs.numel()) % vocab]).reshape(-1)
    return probs


def _sequence_index(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    index = torch.zeros(tokens.shape[0], dtype=torch.long)
    for column in tokens.T:
        index = index * vocab + column
    return index


@pytest.mark.parametrize("seed", [1, 3])
def test_block_verification_keeps_the_target_distribution_and_more_drafts(seed: int) -> None:
    """Whole sequences, not one step: the first 3 tokens of generations with K = 3 follow the
    target chain exactly, and the block rule keeps more drafts per step than the token rule."""
    p, q = _markov_world(seed)
    vocab, length = p.shape[1], 3
    exact = _joint(p, length)
    tokens, drafts, block_kept = _generate(p, q, length, k=3, block=True)
    assert_distribution(_sequence_index(tokens, vocab), exact)
    stat, df = chi_square(torch.bincount(_sequence_index(drafts, vocab), minlength=exact.numel()),
                          exact)
    assert stat > 100 * critical(df), "the test cannot tell the drafts from the target"
    _, _, token_kept = _generate(p, q, length, k=3, block=False)
    assert block_kept > 1.05 * token_kept, (block_kept, token_kept)


def test_block_verification_with_one_hot_drafts_is_the_token_rule() -> None:
    for seed in range(3):
        case = verify_batch(seed=seed)
        outs = []
        for block in (False, True):
            torch.manual_seed(seed)
            outs.append(verify_reference(**{**case, "draft_probs": None}, generators={},
                                         block=block))
        assert torch.equal(*outs)


@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
def test_padding_draft_with_draft_probs_is_corrected_from_the_target(block: bool) -> None:
    """vLLM's padding id (-1) was not drawn from q: its row's correction follows p, not the
    residual max(p - q, 0)."""
    n = NUM_SAMPLES
    drafts = torch.tensor([0, -1]).repeat(n)
    target = torch.stack([P, P]).repeat(n, 1)
    draft_probs = torch.stack([P, Q]).repeat(n, 1)  # first draft q = p: always accepted
    torch.manual_seed(3)
    out = verify_reference(drafts, cu_num_draft_tokens([2] * n), 2, draft_probs, target,
                           torch.full((n,), -7), torch.zeros(n, dtype=torch.bool), {},
                           block=block)
    assert (out[:, 0] == 0).all() and (out[:, 2] == -1).all()
    assert_distribution(out[:, 1].long(), P)


# --------------------------------------------------------------------------- seeds


def test_per_request_generators() -> None:
    torch.manual_seed(0)
    vocab, counts = 50, [4] * 31 + [0]
    drafts = torch.randint(vocab, (sum(counts),))
    target_probs = torch.randn(sum(counts), vocab).softmax(dim=-1)
    bonus = torch.zeros(len(counts), dtype=torch.long)
    is_greedy = torch.zeros(len(counts), dtype=torch.bool)

    def run(seed: int, global_seed: int) -> tuple[torch.Tensor, torch.Generator]:
        generators = {b: torch.Generator().manual_seed(seed + b) for b in range(len(counts))}
        torch.manual_seed(global_seed)
        out = verify_reference(drafts, cu_num_draft_tokens(counts), 4, None, target_probs, bonus,
                               is_greedy, generators)
        return out, generators[len(counts) - 1]

    first, idle_generator = run(seed=10, global_seed=1)
    again, _ = run(seed=10, global_seed=2)  # the default RNG does not matter for seeded requests
    other, _ = run(seed=20, global_seed=1)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    # A seeded request without drafts leaves its generator untouched.
    assert torch.equal(idle_generator.get_state(), torch.Generator().manual_seed(41).get_state())


# --------------------------------------------------------------------------- Triton


def _block_case(seed: int) -> dict:
    """A larger ragged batch whose sampled drafts come from a q near the target, so that block
    verification keeps other drafts than the token rule in several requests."""
    case = verify_batch(batch=48, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    target_probs = case["target_probs"]
    noise = torch.randn(target_probs.shape, generator=gen)
    draft_probs = torch.softmax(torch.log(target_probs + 1e-4) + noise, dim=-1)
    drafts = torch.multinomial(draft_probs, 1, generator=gen)[:, 0]
    drafts[-1] = -1
    return {**case, "draft_probs": draft_probs, "draft_token_ids": drafts}


def _check_triton_matches_reference() -> None:
    """Run with TRITON_INTERPRET=1 set before triton is imported (see the test below)."""
    for seed in range(3):
        case = verify_batch(seed=seed)
        for draft_probs in (None, case["draft_probs"]):
            outs = []
            for fn, block in itertools.product((verify_reference, verify_triton), (False, True)):
                torch.manual_seed(seed)
                generators = {2: torch.Generator().manual_seed(5), 3: torch.Generator()}
                outs.append(fn(**{**case, "draft_probs": draft_probs}, generators=generators,
                               block=block))
            assert torch.equal(outs[0], outs[2]), (seed, draft_probs is None, outs)
            assert torch.equal(outs[1], outs[3]), (seed, draft_probs is None, "block", outs)
            assert (outs[0][:, 0] >= 0).all()
        walk_args = {k: v for k, v in case.items() if k != "draft_token_ids"}
        walk_args["target_argmax"] = case["target_probs"].argmax(dim=-1)
        counts = torch.diff(case["cu_num_draft_tokens"], prepend=torch.zeros(1)).long().tolist()
        vocab = case["target_probs"].shape[1]
        fp64_randoms = draw_randoms(counts, vocab, {}, torch.device("cpu"), fp64_noise=True)
        for randoms in (None, fp64_randoms):
            ref = rejection_walk_reference(case["draft_token_ids"], randoms=randoms, **walk_args)
            tri = rejection_walk_triton(case["draft_token_ids"], randoms=randoms, **walk_args)
            assert torch.equal(ref, tri), (seed, randoms is None)
        block_case = _block_case(seed)
        outs = []
        for fn, block in ((verify_reference, False), (verify_reference, True),
                          (verify_triton, True)):
            torch.manual_seed(seed)
            outs.append(fn(**block_case, generators={4: torch.Generator().manual_seed(6)},
                           block=block))
        assert torch.equal(outs[1], outs[2]), (seed, "block")
        assert (outs[0] != outs[1]).any(dim=1).sum() >= 3, "too few requests where block differs"
        rates = torch.tensor([0.9, 0.8, 0.5, 0.3, 0.0])[: case["max_spec_len"]]
        ref, tri = (walk(case["draft_token_ids"], randoms=fp64_randoms, synthetic_rates=rates,
                         **walk_args)
                    for walk in (rejection_walk_reference, rejection_walk_triton))
        assert torch.equal(ref, tri), (seed, "synthetic")


def test_triton_matches_reference_interpreted() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    code = "import test_verify; test_verify._check_triton_matches_reference()"
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, check=False,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- vLLM adapter


def _metadata(case: dict, all_greedy: bool) -> SimpleNamespace:
    temperature = torch.where(case["is_greedy"], 0.0, 0.7)
    return SimpleNamespace(all_greedy=all_greedy, all_random=False,
                           temperature=None if all_greedy else temperature,
                           generators={2: torch.Generator().manual_seed(5)})


def _adapter(case: dict, metadata: SimpleNamespace, logits: torch.Tensor, **kwargs) -> torch.Tensor:
    counts = torch.diff(case["cu_num_draft_tokens"], prepend=torch.zeros(1)).long().tolist()
    return vllm_rejection_sample(case["draft_token_ids"], counts, case["max_spec_len"],
                                 case["cu_num_draft_tokens"], case["draft_probs"], logits,
                                 case["bonus_token_ids"][:, None], metadata, **kwargs)


@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
def test_vllm_adapter_matches_verify(block: bool) -> None:
    case = _block_case(0)
    logits = torch.log(case["target_probs"]) + 3.0  # softmax(logits) == target_probs
    torch.manual_seed(11)
    out = _adapter(case, _metadata(case, all_greedy=False), logits, block_verification=block)
    torch.manual_seed(11)
    expected = verify(**{**case, "target_probs": logits.softmax(dim=-1)},
                      generators=_metadata(case, all_greedy=False).generators, block=block)
    assert torch.equal(out, expected)


def test_vllm_adapter_all_greedy_is_cheap(monkeypatch: pytest.MonkeyPatch) -> None:
    case = {**verify_batch(seed=1), "draft_probs": None}
    case["is_greedy"] = torch.ones_like(case["is_greedy"])
    logits = 5 * torch.log(case["target_probs"] + 1e-6)  # same argmax, not probabilities

    def no_softmax(*args, **kwargs):
        raise AssertionError("all-greedy verification computed a softmax")

    monkeypatch.setattr(torch.Tensor, "softmax", no_softmax)
    rng_state = torch.get_rng_state()
    out = _adapter(case, _metadata(case, all_greedy=True), logits)
    assert torch.equal(torch.get_rng_state(), rng_state), "all-greedy verification drew randoms"
    monkeypatch.undo()
    assert torch.equal(out, verify(**case, generators={}))


def test_vllm_adapter_without_drafts_returns_the_bonus_tokens_and_draws_nothing() -> None:
    case = verify_batch(seed=3)
    batch, vocab = len(case["bonus_token_ids"]), case["target_probs"].shape[1]
    rng_state = torch.get_rng_state()
    out = vllm_rejection_sample(torch.empty(0, dtype=torch.long), [0] * batch, 1,
                                torch.zeros(batch, dtype=torch.int32), None,
                                torch.empty(0, vocab), case["bonus_token_ids"][:, None],
                                _metadata(case, all_greedy=False))
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert out.tolist() == [[int(b), -1] for b in case["bonus_token_ids"]]
    assert torch.equal(out, verify(torch.empty(0, dtype=torch.long),
                                   torch.zeros(batch, dtype=torch.int32), 1, None,
                                   torch.empty(0, vocab), case["bonus_token_ids"],
                                   case["is_greedy"], {}))


@pytest.mark.parametrize("uniform", [False, True], ids=["ragged", "uniform"])
def test_greedy_walk_torch_matches_reference(uniform: bool) -> None:
    for seed in range(8):
        case = verify_batch(seed=seed)
        if uniform:  # every request drafts max_spec_len tokens
            batch, k = len(case["bonus_token_ids"]), case["max_spec_len"]
            probs = case["target_probs"][:1].expand(batch * k, -1) + 1e-3 * torch.rand(batch * k, 1)
            drafts = probs.argmax(dim=-1)
            drafts[torch.rand(batch * k, generator=torch.Generator().manual_seed(seed)) < 0.2] = 7
            case = {**case, "draft_token_ids": drafts, "target_probs": probs,
                    "cu_num_draft_tokens": cu_num_draft_tokens([k] * batch)}
        counts = torch.diff(case["cu_num_draft_tokens"], prepend=torch.zeros(1)).long().tolist()
        argmax = case["target_probs"].argmax(dim=-1)
        expected = rejection_walk_reference(
            case["draft_token_ids"], case["cu_num_draft_tokens"], case["max_spec_len"], None,
            case["target_probs"], case["bonus_token_ids"], torch.ones(len(counts), dtype=torch.bool),
            argmax, None)
        out = greedy_walk_torch(case["draft_token_ids"], counts, case["max_spec_len"], argmax,
                                case["bonus_token_ids"])
        assert torch.equal(out, expected), (seed, counts)


@pytest.mark.parametrize("all_greedy", [True, False], ids=["greedy", "mixed"])
def test_vllm_adapter_synthetic_mode_accepts_at_the_set_rates(all_greedy: bool) -> None:
    """vLLM's benchmark mode: position i is accepted with probability rates[i], whatever the
    draft; the first rejected position gets the target's token, as in a real rejection."""
    case = verify_batch(seed=2)
    case["draft_token_ids"] = case["draft_token_ids"].clamp_min(0)  # no padding rows
    if all_greedy:
        case["is_greedy"] = torch.ones_like(case["is_greedy"])
    metadata = _metadata(case, all_greedy)
    probs = case["target_probs"]
    counts = torch.diff(case["cu_num_draft_tokens"], prepend=torch.zeros(1)).long().tolist()
    rates = torch.zeros(case["max_spec_len"])
    rates[:2] = 1.0  # every request accepts min(2, its drafts), whatever they are
    out = _adapter(case, metadata, probs.log(), synthetic_mode=True,
                   synthetic_conditional_rates=rates)
    plain = _adapter(case, metadata, probs.log())
    starts = [0, *itertools.accumulate(counts)]
    for b, n in enumerate(counts):
        k = min(2, n)
        assert out[b, :k].tolist() == case["draft_token_ids"][starts[b]: starts[b] + k].tolist()
        if k == n:  # all accepted: then the bonus
            assert out[b, k] == case["bonus_token_ids"][b]
        elif case["is_greedy"][b]:
            assert out[b, k] == probs[starts[b] + k].argmax()
        assert (out[b, k + 1:] == -1).all()
    assert not torch.equal(out, plain)

    # Rate 0.5 at every position: a request with 6 drafts accepts j of them with
    # probability 0.5^(j+1) (j < 6), all 6 with 0.5^6.
    batch, k = 4000, 6
    many = {
        "draft_token_ids": torch.randint(0, probs.shape[1], (batch * k,)),
        "cu_num_draft_tokens": cu_num_draft_tokens([k] * batch),
        "max_spec_len": k,
        "draft_probs": None,
        "bonus_token_ids": torch.zeros(batch, dtype=torch.long),
        "is_greedy": torch.ones(batch, dtype=torch.bool),
    }
    torch.manual_seed(3)
    out = _adapter(many, SimpleNamespace(all_greedy=True, all_random=False, temperature=None,
                                         generators={}),
                   torch.randn(batch * k, probs.shape[1]), synthetic_mode=True,
                   synthetic_conditional_rates=torch.full((k,), 0.5))
    accepted = (out >= 0).sum(dim=1) - 1
    expected = torch.tensor([0.5 ** (j + 1) for j in range(k)] + [0.5**k])
    stat, df = chi_square(torch.bincount(accepted, minlength=k + 1), expected)
    assert stat < critical(df), stat
