"""DraftGraphs' static buffers and padding, run eagerly on CPU (the CUDA capture of the same
step runs in scripts/gpu_check.sh): every batch size gets exactly the tokens of the step run
on its own inputs."""

import torch

from vllm_dflash.draft_graphs import DraftGraphs
from vllm_dflash.kernels.draft_attention import DraftBatch

BLOCK_LEN = 4
MAX_BLOCKS = 6


def step(anchors: torch.Tensor, batch: DraftBatch) -> torch.Tensor:
    """A stand-in draft step whose tokens depend on every input of their own row, like the
    drafter's (each request attends only to its own context and block)."""
    rows = batch.query_start_loc[:-1, None] // BLOCK_LEN
    last_block = batch.block_table.gather(1, (batch.context_lens[:, None] // 16).long())
    offsets = torch.arange(BLOCK_LEN - 1)
    return (anchors[:, None] * 1000 + batch.context_lens[:, None] * 10 + last_block + offsets
            + rows + batch.anchor_positions[:, None] * 100_000)


def inputs(n: int, width: int, seed: int) -> tuple[torch.Tensor, DraftBatch]:
    g = torch.Generator().manual_seed(seed)
    anchors = torch.randint(0, 100, (n,), generator=g, dtype=torch.int32)
    context_lens = torch.randint(0, 16 * min(width, MAX_BLOCKS), (n,), generator=g,
                                 dtype=torch.int32)
    block_table = torch.randint(0, 50, (n, width), generator=g, dtype=torch.int32)
    query_start_loc = torch.arange(n + 1, dtype=torch.int32) * BLOCK_LEN
    # Behind the token count, as under M-RoPE after an image.
    anchor_positions = context_lens - torch.randint(0, 8, (n,), generator=g, dtype=torch.int32)
    return anchors, DraftBatch(block_table, context_lens, query_start_loc, anchor_positions)


def test_every_batch_size_gets_its_own_tokens():
    graphs = DraftGraphs(step, [1, 2, 4, 8], MAX_BLOCKS, BLOCK_LEN, torch.device("cpu"),
                         use_cuda_graph=False)
    graphs.capture()
    # Largest first, so smaller batches run on buffers that hold a larger one's stale rows.
    for n in (8, 7, 5, 4, 3, 2, 1, 6):
        anchors, batch = inputs(n, MAX_BLOCKS, seed=n)
        assert torch.equal(graphs.run(anchors, batch), step(anchors, batch)), n


def test_block_tables_narrower_or_wider_than_the_buffer():
    graphs = DraftGraphs(step, [4], MAX_BLOCKS, BLOCK_LEN, torch.device("cpu"),
                         use_cuda_graph=False)
    for width in (1, MAX_BLOCKS + 3):  # a profile run's one column; a runner's wider table
        anchors, batch = inputs(3, width, seed=width)
        expected = step(anchors, batch)
        assert torch.equal(graphs.run(anchors, batch), expected), width


def test_batches_beyond_the_largest_size_are_left_to_the_eager_step():
    graphs = DraftGraphs(step, [1, 2], MAX_BLOCKS, BLOCK_LEN, torch.device("cpu"),
                         use_cuda_graph=False)
    assert graphs.run(*inputs(3, MAX_BLOCKS, seed=0)) is None

