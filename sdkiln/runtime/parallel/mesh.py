"""The device mesh of a parallel run: process groups for the cfg, Ulysses and ring degrees.

Ranks are laid out ``rank = cfg_rank * (ring * ulysses) + ring_rank * ulysses + ulysses_rank``: the
guidance branches outermost (one all-gather per step crosses them), Ulysses innermost, on adjacent
ranks (its all-to-alls are the heaviest traffic, and adjacent ranks share a node). A sequence is
split across the ``ring * ulysses`` ranks of one cfg rank in that order (its shard number is
``ring_rank * ulysses + ulysses_rank``), so a Ulysses all-to-all gathers contiguous shards and the
ring passes contiguous blocks.

The process group comes from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``) with the platform's collective backend (nccl, hccl, gloo), and
every group of the mesh waits at most ``ParallelConfig.timeout_s`` for a peer (a subgroup does not
inherit the default group's timeout: it is passed to each). A process started without torchrun runs
world size 1 through the same hooks, with no process group. An already initialized process group is
used as it is.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sdkiln.configs.runtime import ParallelConfig
from sdkiln.errors import ParallelError
from sdkiln.kernels.platform import current_platform, platform_class


@dataclass
class Mesh:
    config: ParallelConfig
    rank: int
    world_size: int
    device: torch.device
    cfg_rank: int
    ring_rank: int
    ulysses_rank: int
    cfg_group: dist.ProcessGroup | None
    """The ranks that hold the other guidance branch of this rank's shard (None: cfg 1)."""
    sequence_group: dist.ProcessGroup | None
    """The ring x ulysses ranks that share this rank's sequence (None: no sequence parallelism)."""
    ulysses_group: dist.ProcessGroup | None
    ring_group: dist.ProcessGroup | None
    ring_ranks: tuple[int, ...]
    """Global ranks of this rank's ring, in ring order."""

    @property
    def sequence_degree(self) -> int:
        return self.config.sequence

    @property
    def sequence_rank(self) -> int:
        return self.ring_rank * self.config.ulysses + self.ulysses_rank

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that decodes and writes files."""
        return self.rank == 0

    def describe(self) -> str:
        c = self.config
        return f"{self.world_size} ranks: cfg {c.cfg} x ulysses {c.ulysses} x ring {c.ring}"

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Mesh(rank {self.rank}/{self.world_size}: cfg {self.cfg_rank}/{c.cfg}, ring {self.ring_rank}/{c.ring}, "
            f"ulysses {self.ulysses_rank}/{c.ulysses}, {self.device})"
        )


_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""torch 2.13 renames ``all_gather_into_tensor`` (deprecated there) to ``all_gather_single``."""


_OWNED = False
"""Whether ``init_mesh`` started the process group (``shutdown`` ends only such a one)."""


def shutdown() -> None:
    """End the process group ``init_mesh`` started, once all ranks are done (torch warns at exit
    about one left open); a process group the caller started is the caller's."""
    global _OWNED
    if _OWNED and dist.is_initialized():
        dist.destroy_process_group()
    _OWNED = False


def all_gather(x: torch.Tensor, group, degree: int) -> torch.Tensor:
    """[degree, *x.shape]: ``x`` from every rank of ``group``, in rank order (one collective)."""
    out = torch.empty((degree * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _ALL_GATHER(out, x.contiguous(), group=group)
    return out.view(degree, *x.shape)


def layouts(world_size: int) -> list[str]:
    """Every (cfg, ulysses, ring) whose degrees multiply to ``world_size``, as command-line flags."""
    out = []
    for cfg in (1, 2):
        for ulysses in range(1, world_size + 1):
            rest = world_size // cfg
            if world_size % cfg or rest % ulysses:
                continue
            ring = rest // ulysses
            flags = (["--cfg-parallel"] if cfg == 2 else []) + [f"--ulysses {ulysses}"] * (ulysses > 1)
            flags += [f"--ring {ring}"] * (ring > 1)
            out.append(" ".join(flags) or "(none)")
    return out


def _launched_world() -> tuple[int, int, int] | None:
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    except (KeyError, ValueError):
        raise ParallelError(
            "WORLD_SIZE is set but RANK is missing or not an integer: launch with torchrun"
        ) from None


def _device(device: torch.device, world: int, local_rank: int) -> torch.device:
    """This rank's device: with peers, the accelerator numbered ``LOCAL_RANK`` (torchrun's one
    process per device; ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` choose the devices),
    whatever index ``device`` named (``"auto"`` names device 0); alone, ``device`` as it is."""
    if device.type == "cpu" or world == 1:
        return device
    return torch.device(device.type, local_rank)


def init_mesh(config: ParallelConfig, device: torch.device) -> Mesh:
    """Join (or start) the process group and build the mesh of ``config`` on ``device``'s platform."""
    launched = _launched_world()
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))
    elif launched is not None:
        rank, world, local = launched
    else:
        rank, world, local = 0, 1, 0
    if world != config.world_size:
        launch = f"torchrun --nproc-per-node {config.world_size} -m sdkiln run ..."
        raise ParallelError(
            f"cfg {config.cfg} x ulysses {config.ulysses} x ring {config.ring} needs {config.world_size} processes, "
            + (
                f"this process was not launched by torchrun: launch {launch}"
                if world == 1
                else f"this run has {world}; with {world}, choose one of: {'; '.join(layouts(world))} (or launch {launch})"
            )
        )
    device = _device(device, world, local)
    owns = not initialized and launched is not None
    timeout = datetime.timedelta(seconds=config.timeout_s)
    global _OWNED
    if owns:
        if device.type != "cpu":  # a CPU run on an accelerator's machine leaves its current device alone
            current_platform().set_device(device)
        backend = platform_class(device.type).dist_backend
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        _OWNED = True
    if world == 1:  # no peer: nothing to communicate with, no process group needed
        return Mesh(config, 0, 1, device, 0, 0, 0, None, None, None, None, (0,))
    c, r, u = config.cfg, config.ring, config.ulysses
    cfg_rank, rest = divmod(rank, r * u)
    ring_rank, ulysses_rank = divmod(rest, u)

    def group(members: list[list[int]], degree: int):
        """Every process creates every group, in the same order (``new_group``'s rule); the one
        this rank is in is returned."""
        mine = None
        for ranks in members:
            g = dist.new_group(ranks, timeout=timeout) if degree > 1 else None
            if rank in ranks:
                mine = g
        return mine

    seq = [[cc * r * u + i for i in range(r * u)] for cc in range(c)]
    cfgs = [[cc * r * u + i for cc in range(c)] for i in range(r * u)]
    ulys = [[cc * r * u + rr * u + uu for uu in range(u)] for cc in range(c) for rr in range(r)]
    rings = [[cc * r * u + rr * u + uu for rr in range(r)] for cc in range(c) for uu in range(u)]
    return Mesh(
        config=config,
        rank=rank,
        world_size=world,
        device=device,
        cfg_rank=cfg_rank,
        ring_rank=ring_rank,
        ulysses_rank=ulysses_rank,
        cfg_group=group(cfgs, c),
        sequence_group=group(seq, r * u),
        ulysses_group=group(ulys, u),
        ring_group=group(rings, r),
        ring_ranks=tuple(next(g for g in rings if rank in g)),
    )
