"""torchrun support: this process's place in the world, its process group and collectives.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Without them, or with
WORLD_SIZE 1, the trainer runs alone: no process group, nothing wrapped, nothing reduced.
Several ranks train one drafter data-parallel (DDP): each holds a copy, trains on its shard of
the data, and the gradients are averaged over the ranks in every backward that syncs. With
--fsdp-target the frozen target's decoder is sharded over the ranks (FSDP) instead of copied.
"""

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0 evaluates, logs and saves."""
        return self.rank == 0


ALONE = World()


def launched_size() -> int:
    """The world size torchrun launched (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def join_world(device: str) -> tuple[World, str]:
    """This process's world with its process group started (NCCL for CUDA, gloo on CPU), and
    its device: cuda:LOCAL_RANK when device is a CUDA one."""
    if launched_size() == 1:
        return ALONE, device
    world = World(int(os.environ["RANK"]), launched_size(), int(os.environ.get("LOCAL_RANK", "0")))
    if device.startswith("cuda"):
        device = f"cuda:{world.local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend(device))
    return world, device


def leave_world(world: World) -> None:
    if world.size > 1:
        dist.destroy_process_group()


def all_sum(values: list[float], world: World, device: str) -> list[float]:
    """values summed elementwise over the ranks (as they are, alone)."""
    if world.size == 1:
        return values
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def all_max(value: float, world: World, device: str) -> float:
    """The largest of the ranks' values (value itself, alone)."""
    if world.size == 1:
        return value
    largest = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


def shard_decoder(target: torch.nn.Module) -> None:
    """The target's decoder (the part the features come from) sharded over the ranks with
    FSDP: each rank keeps 1/world size of every decoder layer, and a forward gathers one layer
    at a time (and frees it after). Every rank must then run the same forwards."""
    from torch.distributed.fsdp import fully_shard

    decoder = target.get_decoder()
    for layer in decoder.layers:
        fully_shard(layer)
    # The root's own weights (the embedding, the final norm) too: FSDP keeps a root's gathered
    # after its forward unless told otherwise.
    fully_shard(decoder, reshard_after_forward=True)


def data_parallel(module: torch.nn.Module, world: World, device: str) -> torch.nn.Module:
    """module in DDP when there are several ranks, else module itself."""
    if world.size == 1:
        return module
    device_ids = [torch.device(device).index] if device.startswith("cuda") else None
    return DistributedDataParallel(module, device_ids=device_ids)


def syncing(model: torch.nn.Module, sync: bool) -> AbstractContextManager:
    """Where a forward + backward of model happens: outside DDP's no_sync when it is to sync the
    gradients over the ranks, inside it when they are only accumulated."""
    if sync or not isinstance(model, DistributedDataParallel):
        return nullcontext()
    return model.no_sync()
