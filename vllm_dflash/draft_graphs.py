"""CUDA graphs of the drafter's pass: one per batch size, replayed on static input buffers.

A drafter's pass launches some 70 kernels per draft layer; at small batch sizes launching them
takes longer than running them. Its shapes depend only on the number of requests (each drafts
one block of block_len tokens), so one graph per batch size covers it. A step copies its inputs
into the static buffers, replays the smallest graph that fits, and keeps the first rows of its
output. Padded rows draft from an empty context, and their rows are dropped. The lm_head and
the token choice (greedy or sampled) run after the graph, on the rows the step takes; KV
injection stays eager: its token count changes with every step's acceptance.
"""

from collections.abc import Callable

import torch

from vllm_dflash.kernels.draft_attention import DraftBatch

# (anchors [B] int32, batch) -> [B, ...] outputs; device work only, no host syncs.
DraftStep = Callable[[torch.Tensor, DraftBatch], torch.Tensor]


class DraftGraphs:
    """The draft step captured at each of batch_sizes. With use_cuda_graph=False the same
    buffers and padding run eagerly (how the CPU tests check them)."""

    def __init__(self, step: DraftStep, batch_sizes: list[int], max_blocks: int,
                 block_len: int, device: torch.device, use_cuda_graph: bool = True) -> None:
        self.step = step
        self.sizes = sorted(set(batch_sizes))
        largest = self.sizes[-1]
        self.anchors = torch.zeros(largest, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.anchor_positions = torch.zeros(largest, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(largest, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.query_start_loc *= block_len
        self.use_cuda_graph = use_cuda_graph
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def static_inputs(self, size: int) -> tuple[torch.Tensor, DraftBatch]:
        batch = DraftBatch(self.block_table[:size], self.context_lens[:size],
                           self.query_start_loc[: size + 1], self.anchor_positions[:size])
        return self.anchors[:size], batch

    def capture(self) -> None:
        """Largest first, all in one memory pool: a smaller graph reuses the larger's memory."""
        if not self.use_cuda_graph:
            return
        pool = None
        for size in reversed(self.sizes):
            inputs = self.static_inputs(size)
            # Warm-up outside the graph, on a side stream as torch.cuda.graph asks: Triton
            # compiles, cuBLAS sets up its workspace.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step(*inputs)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.step(*inputs)
            pool = graph.pool()
            self.graphs[size] = graph

    def run(self, anchors: torch.Tensor, batch: DraftBatch) -> torch.Tensor | None:
        """The step's [B, ...] outputs, or None when B is larger than every captured size."""
        n = anchors.shape[0]
        size = next((s for s in self.sizes if s >= n), None)
        if size is None:
            return None
        self.anchors[:n].copy_(anchors)
        self.context_lens[:n].copy_(batch.context_lens)
        self.context_lens[n:size].zero_()
        self.anchor_positions[:n].copy_(batch.anchor_positions)
        self.anchor_positions[n:size].zero_()
        # Contexts fit in max_blocks (max_model_len); later columns are never read.
        width = min(self.block_table.shape[1], batch.block_table.shape[1])
        self.block_table[:n, :width].copy_(batch.block_table[:, :width])
        if self.use_cuda_graph:
            self.graphs[size].replay()
            out = self.outputs[size]
        else:
            out = self.step(*self.static_inputs(size))
        # A copy: the next replay overwrites the graph's output buffer.
        return out[:n].clone()
