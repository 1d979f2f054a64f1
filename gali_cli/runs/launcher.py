"""The processes of a batch under torchrun or `accelerate launch` (RANK / WORLD_SIZE in the environment): this
process's place among them and its share of the documents (every WORLD_SIZE-th of the sorted list), and the
collective that lets them wait for one another and add up their counts.
"""

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from ..errors import ConfigError


@dataclass(frozen=True)
class Rank:
    """This process's place among the launcher's processes (0 of 1 when run alone)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_environment(cls) -> "Rank":
        """From RANK / WORLD_SIZE / LOCAL_RANK, which torchrun and `accelerate launch` set."""
        try:
            rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
        except ValueError as error:
            raise ConfigError(f"RANK / WORLD_SIZE / LOCAL_RANK must be whole numbers: {error}") from None
        if not 0 <= rank < world:
            raise ConfigError(f"RANK {rank} is not within WORLD_SIZE {world}")
        return cls(rank, world, local_rank)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def shard(self, documents: list[Path]) -> list[Path]:
        """This process's documents: every world-th of the list, starting at its rank (the same split on every
        process, as each expands the same arguments)."""
        return documents[self.rank :: self.world]


class Collective:
    """The processes of a distributed batch, over torch.distributed's gloo backend (CPU or GPU machines alike)."""

    def __init__(self, rank: Rank, hours: float = 72.0) -> None:
        import torch.distributed as dist

        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise ConfigError(f"WORLD_SIZE is {rank.world} but {' and '.join(missing)} are not set: start gali "
                              "with torchrun or accelerate launch")
        self.dist = dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank.rank, world_size=rank.world, timeout=timedelta(hours=hours))

    def total(self, value: int) -> int:
        """The sum of `value` over all processes; returns when every process has called it."""
        import torch

        tensor = torch.tensor([value])
        self.dist.all_reduce(tensor)
        return int(tensor.item())

    def wait(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        self.dist.destroy_process_group()
