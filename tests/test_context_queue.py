"""Deferred KV injection (context_queue.py): the queued steps leave the drafter's cache as
injecting step by step does, slot reuse and queue overflow included."""

import torch

from vllm_dflash.context_queue import ContextQueue, superseded_writes
from vllm_dflash.kernels.inputs import injection_batch
from vllm_dflash.kernels.kv_injection import kv_injection_reference

HIDDEN = 32


def test_superseded_writes() -> None:
    slots = torch.tensor([5, 3, 5, -1, 3, 7, -1])
    assert superseded_writes(slots).tolist() == [True, True, False, True, False, False, False]


def _steps(num_steps: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """Steps of 1-9 tokens over 12 slots, so that later steps overwrite earlier ones' slots
    (blocks reused after a request ends); slot -1 is padding."""
    steps = []
    for _ in range(num_steps):
        n = int(torch.randint(1, 10, (), generator=gen))
        slots = torch.randint(-1, 12, (n,), generator=gen)
        positions = torch.randint(0, 200, (n,), generator=gen)
        chunks = [torch.randn(n, HIDDEN // 2, generator=gen) for _ in range(2)]
        steps.append((chunks, positions, slots))
    return steps


def test_queued_steps_write_the_cache_as_step_by_step_injection() -> None:
    gen = torch.Generator().manual_seed(0)
    args = injection_batch(40, HIDDEN, 2, 2, 16, torch.float32, ["contiguous"], seed=1)
    weights = [args[name] for name in ("kv_weight", "k_norm_weight", "eps", "cos_sin_cache")]

    def cache_injector(one_write_per_slot: bool):
        caches = [torch.zeros_like(c) for c in args["kv_caches"]]
        calls = []

        def inject(ctx, positions, slots):
            calls.append(ctx.shape[0])
            # The GPU kernels write a batch's tokens in parallel: the order of two writes to
            # one slot would be undefined.
            written = slots[slots >= 0]
            assert not one_write_per_slot or len(written.unique()) == len(written), slots
            kv_injection_reference(ctx.clone(), positions.clone(), slots.clone(), *weights,
                                   caches)

        return caches, calls, inject

    direct_caches, _, direct = cache_injector(one_write_per_slot=False)
    queued_caches, calls, inject = cache_injector(one_write_per_slot=True)
    queue = ContextQueue(16, HIDDEN, torch.float32, torch.device("cpu"), inject)
    # A step larger than the queue (a prefill) between the decode-sized ones.
    prefill = ([torch.randn(20, HIDDEN // 2, generator=gen)] * 2, torch.arange(20),
               torch.arange(12, 32))
    steps = _steps(15, gen) + [prefill] + _steps(15, gen)
    for chunks, positions, slots in steps:
        direct(torch.cat(chunks, dim=-1), positions, slots)
        queue.put(chunks, positions, slots)
    queue.flush()
    assert queue.num_tokens == 0
    assert 1 < len(calls) < len(steps) / 2, calls  # full queues flushed, far fewer injections
    assert set(calls) <= set(queue.batch_sizes()) | {20}, calls  # 20: the prefill, at once
    for got, want in zip(queued_caches, direct_caches, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    num_calls = len(calls)
    queue.flush()  # empty: injects nothing
    assert len(calls) == num_calls


def test_warm_up_injects_every_flush_size_and_writes_nothing() -> None:
    calls = []

    def inject(ctx, positions, slots):
        calls.append(ctx.shape[0])
        assert (slots == -1).all()

    queue = ContextQueue(24, HIDDEN, torch.float32, torch.device("cpu"), inject)
    assert queue.batch_sizes() == [1, 2, 4, 8, 16, 24]
    queue.warm_up()
    assert calls == queue.batch_sizes()
