"""The CPU collectives between tensor-parallel workers on one host: shared memory and flags.

The executor creates one segment per group (`ShmGroup.create`, a name the OS makes unique, so
two engines on one host never collide); each rank attaches with `ShmCommunicator(handle, rank)`.
Layout: a 64-byte line of flags per rank (its barrier epoch and its pid), then one data slot per
rank of `slot_bytes`.

A collective is: every rank writes its tensor into its own slot; barrier; every rank reads all
slots and combines them in rank order (graph/collective_ops.py's references: the sum
((x0 + x1) + x2) + ... in f32, or the slots side by side); barrier, so no slot is overwritten
before every rank has read it. Tensors larger than a slot go in chunks. Every rank computes
the same result from the same bytes in the same order: deterministic and identical on every rank.

The barrier is one monotonic epoch per rank, written only by its rank (no atomics needed): a
rank passes barrier k once every rank's epoch is >= k. Waiting spins briefly, then sleeps in
growing steps (the workers share cores with each other); it checks that its peers and its
parent are alive, so a dead peer raises PeerDiedError instead of a hang. The segment is a
vLLM shm_broadcast.py idea used for the data itself (there it carries the broadcast of the
step's inputs; reductions go through NCCL or gloo, neither of which kiln has on the CPU).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

FLAG_BYTES = 64  # one cache line of flags per rank: [epoch, pid, 0...]
DEFAULT_SLOT_BYTES = 4 << 20


class PeerDiedError(RuntimeError):
    """A rank of the group (or the process that started it) is gone mid-collective."""


@dataclass(frozen=True)
class ShmHandle:
    """What a rank needs to attach: picklable, sent to each worker."""
    name: str
    world_size: int
    slot_bytes: int
    owner_pid: int = 0


class ShmGroup:
    """The owner's side: creates and finally unlinks the segment."""

    def __init__(self, world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        size = world_size * (FLAG_BYTES + slot_bytes)
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.shm.buf[:world_size * FLAG_BYTES] = bytes(world_size * FLAG_BYTES)
        self.handle = ShmHandle(self.shm.name, world_size, slot_bytes, os.getpid())

    def close(self) -> None:
        if self.shm is not None:
            shm, self.shm = self.shm, None
            shm.close()
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


def _attach(name: str, owner_pid: int) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name)
    if os.getpid() == owner_pid:  # ranks on threads of the owner (tests): one registration, the owner's
        return shm
    try:  # the owner unlinks it; this process's resource tracker must not (Python < 3.13 registers attaches)
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:  # pragma: no cover - a tracker that never registered it
        pass
    return shm


class ShmCommunicator:
    def __init__(self, handle: ShmHandle, rank: int, *, watch_parent: bool = True) -> None:
        self.rank, self.world_size, self.slot_bytes = rank, handle.world_size, handle.slot_bytes
        self.shm = _attach(handle.name, handle.owner_pid)
        n = self.world_size
        self.flags = np.ndarray((n, FLAG_BYTES // 8), np.int64, buffer=self.shm.buf)
        self.slots = [np.ndarray((self.slot_bytes,), np.uint8, buffer=self.shm.buf,
                                 offset=n * FLAG_BYTES + r * self.slot_bytes) for r in range(n)]
        self.epoch = int(self.flags[rank, 0])
        self.flags[rank, 1] = os.getpid()
        self._parent = os.getppid() if watch_parent else None

    def close(self) -> None:
        self.flags = self.slots = None
        try:
            self.shm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with the process
            pass

    # -- the barrier -------------------------------------------------------------------------
    def barrier(self) -> None:
        self.epoch += 1
        self.flags[self.rank, 0] = self.epoch
        epochs = self.flags[:, 0]
        spins, delay, next_check = 0, 0.0, time.monotonic() + 0.2
        while (epochs < self.epoch).any():
            spins += 1
            if spins < 200:
                continue
            time.sleep(delay)
            delay = min(1e-3, delay * 2 or 2e-5)
            if time.monotonic() > next_check:
                self._check_alive()
                next_check = time.monotonic() + 0.2

    def _check_alive(self) -> None:
        if self._parent is not None and os.getppid() != self._parent:
            raise PeerDiedError(f"rank {self.rank}: the process that started the group is gone")
        for r in range(self.world_size):
            pid = int(self.flags[r, 1])
            if r == self.rank or pid == 0 or self.flags[r, 0] >= self.epoch:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise PeerDiedError(f"rank {r} (pid {pid}) of the tensor-parallel group is gone") from None
            except PermissionError:
                pass

    # -- collectives -----------------------------------------------------------------------
    def _view(self, r: int, dtype: np.dtype, count: int) -> np.ndarray:
        return self.slots[r][:count * dtype.itemsize].view(dtype)

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """The sum over the ranks in rank order, f32 accumulation (collective_ops.all_reduce_reference)."""
        flat = np.ascontiguousarray(x).reshape(-1)
        out = np.empty(flat.shape, x.dtype)
        per = max(1, self.slot_bytes // flat.dtype.itemsize)
        for a in range(0, max(flat.size, 1), per):
            piece = flat[a:a + per]
            self._view(self.rank, flat.dtype, piece.size)[:] = piece
            self.barrier()
            acc = self._view(0, flat.dtype, piece.size).astype(np.float32)
            for r in range(1, self.world_size):
                acc += self._view(r, flat.dtype, piece.size)
            out[a:a + piece.size] = acc
            self.barrier()
        return out.reshape(x.shape)

    def all_gather(self, x: np.ndarray, size: int) -> np.ndarray:
        """x: [..., Np] -> [..., size]: every rank's columns side by side in rank order, cut to size."""
        rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        npr = rows.shape[1]
        if npr * rows.dtype.itemsize > self.slot_bytes:
            raise ValueError(f"all_gather: a row of {npr} columns does not fit a {self.slot_bytes}-byte slot")
        out = np.empty((rows.shape[0], npr * self.world_size), rows.dtype)
        per = max(1, self.slot_bytes // (npr * rows.dtype.itemsize))
        for a in range(0, max(rows.shape[0], 1), per):
            piece = rows[a:a + per]
            self._view(self.rank, rows.dtype, piece.size)[:] = piece.reshape(-1)
            self.barrier()
            for r in range(self.world_size):
                out[a:a + len(piece), r * npr:(r + 1) * npr] = self._view(r, rows.dtype, piece.size).reshape(piece.shape)
            self.barrier()
        return out[:, :size].reshape(*x.shape[:-1], size)
