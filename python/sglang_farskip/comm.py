"""Every collective of the project: start an all-reduce, get a handle, wait for it later.

    handle = comm.start_all_reduce(partial)     # the sum starts now
    ...                                         # compute that does not read the sum
    full = handle.wait()                        # right before the add that reads it

Semantics, per backend (chosen once per communicator):
- Identity (world size 1): the "sum" is the input; wait() returns it.
- Blocking: the sum is computed inside start_all_reduce with the group's own best path
  (SGLang's GroupCoordinator.all_reduce on GPU: custom AR / pynccl / NCCL; gloo on CPU); the
  handle is already complete. This is FarSkip's `sync` mode: the same wiring, no overlap.
- Async torch.distributed (`async_op=True`): gloo runs the reduction on its own thread, so
  on CPU the sum really proceeds while the caller computes; wait() blocks on the Work.
  The partial passed in is reduced in place: the caller must not touch it until wait().

Every rank must start the same collectives in the same order; a handle must be waited exactly
once (a second wait is a bug in the schedule and raises).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class Handle:
    """A started all-reduce. `wait()` returns the reduced tensor, once."""

    __slots__ = ("_tensor", "_work", "_waited")

    def __init__(self, tensor: torch.Tensor, work: Optional[dist.Work] = None):
        self._tensor = tensor
        self._work = work
        self._waited = False

    def wait(self) -> torch.Tensor:
        if self._waited:
            raise RuntimeError("all-reduce handle waited twice: the FarSkip schedule is wrong")
        self._waited = True
        if self._work is not None:
            self._work.wait()
            self._work = None
        tensor, self._tensor = self._tensor, None  # drop our reference: the caller owns it now
        return tensor


class Communicator:
    """All-reduce over one process group, either blocking or asynchronous.

    `group` is SGLang's GroupCoordinator (or anything with `world_size`, `all_reduce(t)` and
    `device_group`); it is passed in explicitly, never looked up from model code.
    """

    def __init__(self, group, *, asynchronous: bool):
        self.group = group
        self.world_size = group.world_size if group is not None else 1
        self.asynchronous = asynchronous and self.world_size > 1
        if self.asynchronous and not self._supports_async(group):
            raise NotImplementedError(
                "asynchronous all-reduce is implemented for CPU (gloo) groups only so far; "
                "use --farskip-mode sync on this device"
            )

    @staticmethod
    def _supports_async(group) -> bool:
        return dist.get_backend(group.device_group) == "gloo"

    @property
    def backend(self) -> str:
        if self.world_size == 1:
            return "identity"
        return "async-torch.distributed" if self.asynchronous else "blocking"

    def start_all_reduce(self, tensor: torch.Tensor) -> Handle:
        if self.world_size == 1:
            return Handle(tensor)
        if not self.asynchronous:
            return Handle(self.group.all_reduce(tensor))
        tensor = tensor.contiguous()
        work = dist.all_reduce(tensor, group=self.group.device_group, async_op=True)
        return Handle(tensor, work)
