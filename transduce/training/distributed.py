"""Training on several processes at once (data parallel): the ranks torchrun starts, or `transduce train --nproc N`
(training.launch), one device each, joined in one torch.distributed process group (NCCL on GPUs, gloo on CPUs);
DistributedDataParallel averages their gradients. The rules (docs/design/distributed.md):

- The batch is global: --max-tokens is the budget of the batch that all ranks take one step on, cut and ordered as
  on one process. Each rank takes its share (split_batch): the batch cut into ranks x accumulate parts of as many
  pairs, rank r taking parts r*K .. r*K + K - 1 (K = --accumulate), run one after the other.
- The loss is the global batch's mean over its target tokens: each part's mean is weighted by its share of the
  batch's tokens times the number of ranks (part_weight), which the ranks' averaged gradients divide again, so the
  gradient is the one a single process computes on the whole batch.
- Rank 0 owns the output directory: it alone locks, reads and writes it, trains the tokenizer and validates, and
  shares what the others need, or its error, through the process group (World.from_rank0).
- Every collective gives up after --collective-timeout seconds; a rank that loses the others fails with a
  DistributedError (comm_failure tells such errors from others).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from transduce.errors import ConfigError, DistributedError, TransduceError


@dataclass
class World:
    """The processes of one run and this one's place among them; a single process is World()."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0  # its place on its machine: which GPU it takes
    local_size: int = 1
    owned: bool = False  # this run made the process group (and ends it)
    backend: str = ""

    @property
    def comm_device(self) -> str:
        """Where the tensors of a collective live: NCCL's are on the rank's GPU."""
        import torch

        return f"cuda:{torch.cuda.current_device()}" if self.backend == "nccl" else "cpu"

    def from_rank0(self, fn: Callable[[], Any], share: Callable[[Any], Any] | None = None) -> Any:
        """fn() run on rank 0 alone: its result there; on the other ranks share(result) (default: the result),
        sent through the process group. An error of fn's is raised on every rank, the others' copies marked
        `mirrored` (the command prints rank 0's alone)."""
        if self.size == 1:
            return fn()
        if self.rank != 0:
            kind, value = self._broadcast(None)
            if kind == "ok":
                return value
            error = value if kind == "error" else DistributedError(f"rank 0 stopped: {value}")
            error.mirrored = True
            raise error
        try:
            result = fn()
        except TransduceError as e:
            self._broadcast(("error", e))
            raise
        except BaseException as e:  # a bug or Ctrl-C on rank 0: the others stop too, without a second message
            self._broadcast(("failed", f"{type(e).__name__}: {e}"))
            raise
        self._broadcast(("ok", share(result) if share is not None else result))
        return result

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        return obj if self.size == 1 else self._broadcast(obj)

    def _broadcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.comm_device)
        return box[0]

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values` (as many on each), in rank order, on every rank."""
        if self.size == 1:
            return [list(values)]
        import torch
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=torch.float64, device=self.comm_device)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine)
        return [t.tolist() for t in every]

    def rng_states(self, device) -> dict[str, Any]:
        """At rank 0, the other ranks' RNG states as a checkpoint keeps them ("torch.R", "cuda.R"); {} elsewhere
        and on a single process (its own states are the checkpoint's "torch" and "cuda")."""
        if self.size == 1:
            return {}
        import torch.distributed as dist

        every = [None] * self.size if self.rank == 0 else None
        dist.gather_object(own_rng_state(device), every, dst=0)
        if self.rank != 0:
            return {}
        return {f"{name}.{r}": state for r, states in enumerate(every) if r for name, state in states.items()}


def own_rng_state(device) -> dict[str, Any]:
    import torch

    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def rank_rng_state(rng: dict[str, Any] | None, rank: int) -> dict[str, Any] | None:
    """A rank's RNG states among a checkpoint's (rank 0's are "torch" and "cuda", rank R's "torch.R"...); None if
    it has none (a resume on more ranks than saved)."""
    if rng is None:
        return None
    if rank == 0:
        return rng
    mine = {name.removesuffix(f".{rank}"): t for name, t in rng.items() if name.endswith(f".{rank}")}
    return mine or None


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s dropout (rank 0 keeps the run's seed, as a single process does): the ranks' masks
    differ, and are the same in every run with this seed."""
    if rank == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{rank}".encode()).digest()[:8], "little") >> 1


def split_batch(batch: list, parts: int) -> list[list]:
    """`batch` (length-sorted) cut into `parts` runs of consecutive pairs, as many in each as can be (the first
    ones may be a pair shorter, or empty when the batch has fewer pairs than parts)."""
    n = len(batch)
    return [batch[i * n // parts:(i + 1) * n // parts] for i in range(parts)]


def part_weight(part_tokens: int, batch_tokens: int, ranks: int) -> float:
    """The factor of a part's mean loss: its tokens' share of the global batch's, times the ranks whose gradients
    DistributedDataParallel averages. Summed over the parts of all ranks, the weighted means are the batch's mean
    loss times the ranks, whose average is the batch's mean: one process's loss and gradient on the whole batch."""
    return part_tokens * ranks / batch_tokens


def comm_failure(e: BaseException) -> bool:
    """Whether `e` is a collective that failed: a peer gone (connection reset), unreachable, or past the timeout."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(mark in text for mark in (
        "gloo", "Gloo", "NCCL", "Connection", "onnection closed", "imed out", "Timeout", "Broken pipe", "socket"))


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None or not value.strip():
        if default is None:
            raise ConfigError(f"the environment names a run on several processes (WORLD_SIZE) but not ${name}",
                              hint="start the ranks with torchrun, or with transduce train --nproc N")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name} must be an integer, got {value!r}") from None


def rank_device(name: str, world: World) -> str:
    """The device a rank trains on: the GPU of its local rank for "cuda" on several processes; a single process's
    is `name`. "cuda:N" names one GPU, which is refused for several ranks on one machine."""
    if world.size == 1:
        return name
    from transduce.runtime.devices import parse_device

    kind, index = parse_device(name, "--device", ConfigError, "training runs")
    if kind == "cpu":
        return "cpu"
    if index is not None and world.local_size > 1:
        raise ConfigError(f"device {name} names one GPU, but this machine runs {world.local_size} ranks",
                          hint="give device cuda: each rank trains on the GPU of its local rank", params=("device",))
    return f"cuda:{world.local_rank if index is None else index}"


@contextlib.contextmanager
def joined(device: str, timeout_s: float) -> Iterator[World]:
    """The World of this process: the process group a caller made already, or one made from torchrun's
    environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) and ended after; World() for a single process.
    `device` picks the backend: NCCL for cuda, gloo for cpu; collectives give up after `timeout_s`."""
    import datetime

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        yield World(dist.get_rank(), dist.get_world_size(), _env_int("LOCAL_RANK", dist.get_rank()),
                    _env_int("LOCAL_WORLD_SIZE", dist.get_world_size()), backend=dist.get_backend())
        return
    size = _env_int("WORLD_SIZE", 1)
    if size <= 1:
        yield World()
        return
    if not dist.is_available():
        raise ConfigError("this torch has no torch.distributed: it trains on one process",
                          hint="install a torch build with distributed support, or run one process")
    rank = _env_int("RANK")
    world = World(rank, size, _env_int("LOCAL_RANK", rank), _env_int("LOCAL_WORLD_SIZE", size), owned=True)
    try:
        world.backend = "nccl" if rank_device(device, world).startswith("cuda") else "gloo"
    except TransduceError as e:  # every rank finds the same: rank 0's copy is printed
        e.mirrored = rank != 0
        raise
    if world.backend == "nccl":
        import torch

        from transduce.training.checks import training_device

        torch.cuda.set_device(training_device(rank_device(device, world)))  # NCCL's GPU: the rank's own
    try:
        dist.init_process_group(world.backend, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # the rendezvous: a rank that never came, an address that cannot be bound
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise DistributedError(f"rank {rank} of {size} could not join the others: {first}",
                               hint="check MASTER_ADDR and MASTER_PORT, and that every rank was started") from None
    try:
        yield world
    finally:
        # DistributedDataParallel's hooks hold it in reference cycles: collected now, its reducer lets go of the
        # process group here, not during the interpreter's exit (where gloo's threads can abort the process)
        gc.collect()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
