"""The tensor-parallel executor: one worker process per rank, driven from the engine core.

vLLM's vllm/v1/executor/multiproc_executor.py in shape: the scheduler stays in the engine core;
each step's inputs go to every worker (vLLM broadcasts them through a shared-memory queue; here
one pickled message per worker over its socket: a step's inputs are a few int32 arrays), every
worker runs its rank's graph, the collectives join them (runtime/worker/shm_communicator.py),
and rank 0's outputs (the full logits: the LM head's all_gather) come back. The others answer
"ok" only, so an error on any rank is seen at once.

A worker that dies fails the engine loudly, never a hang: its socket reads EOF (vLLM watches
process sentinels the same way, in its worker monitor thread), the executor kills the other
workers, frees the shared memory and raises WorkerDiedError from the step, which ends the
engine (AsyncLLM: every in-flight request gets EngineDeadError, /health answers 503); a worker
waiting in a collective sees its peer gone (PeerDiedError) or its parent gone and exits.

Workers are started with subprocess (`python -m kiln.runtime.worker.tp_worker FD`), not
multiprocessing: the server's engine core is itself a daemonic multiprocessing child, which
multiprocessing forbids to have children. What a worker builds is the caller's business:
`make_worker(rank, comm)` is a picklable callable (kiln.loader's) returning an executor with
execute / copy_state_slots / num_blocks / num_state_slots; the runtime only runs it.

GPU ranks (nccl=True): no shared memory; rank 0 makes an NCCL unique id (which hosts the
group's bootstrap root in rank 0's process) and sends it up the socket, the executor hands it
to the other ranks, and every rank's make_worker gets an NcclBootstrap (runtime/worker/nccl.py)
in place of the shared-memory communicator. The id is how torch.distributed and vLLM form an
NCCL group too (rank 0's id, broadcast); here it rides the channel the workers already have.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Mapping

import numpy as np

from kiln.runtime.worker.shm_communicator import ShmGroup

MakeWorker = Callable[[int, Any], Any]


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone or failed: the engine cannot go on."""


def _kill(procs: list, group: ShmGroup | None) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.kill()
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a kill that did not take
            pass
    if group is not None:
        group.close()


class MultiprocExecutor:
    def __init__(self, make_worker: MakeWorker, world_size: int, *, start_timeout: float = 600.0,
                 nccl: bool = False) -> None:
        self.world_size = world_size
        self.group = None if nccl else ShmGroup(world_size)
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._dead: str | None = None
        threads = max(1, (os.cpu_count() or 1) // world_size)  # the ranks share the cores: no oversubscribed BLAS
        env = {**os.environ, **{k: os.environ.get(k, str(threads)) for k in
                                ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")},
               # the caller's import path, as multiprocessing's spawn hands it on: make_worker unpickles there
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._finalizer = weakref.finalize(self, _kill, self.procs, self.group)
        for rank in range(world_size):
            mine, theirs = socket.socketpair()
            p = subprocess.Popen([sys.executable, "-m", "kiln.runtime.worker.tp_worker", str(theirs.fileno())],
                                 pass_fds=[theirs.fileno()], env=env, start_new_session=False)
            theirs.close()
            self.procs.append(p)
            conn = Connection(mine.detach())
            self.conns.append(conn)
            conn.send(("init", make_worker, rank, world_size, self.group.handle if self.group else None, nccl))
        if nccl:  # rank 0's NCCL id to the others
            uid = self._gather(timeout=start_timeout, what="make an NCCL id", ranks=[0])[0]
            for c in self.conns[1:]:
                c.send(("nccl_id", uid))
        infos = self._gather(timeout=start_timeout, what="start")
        # every rank holds at least this many blocks (a GPU rank sizes its cache from its free memory)
        self.num_blocks = min(i["num_blocks"] for i in infos)
        self.num_state_slots = infos[0]["num_state_slots"]
        self.buckets = infos[0].get("buckets", [])  # a GPU rank's plans' sizes (the engine reads the logits rows)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- the interface the model runner uses ---------------------------------------------------
    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._call(("execute", {k: np.asarray(v) for k, v in inputs.items()}))[0]

    def copy_state_slots(self, copies) -> None:
        if copies:
            self._call(("copy", list(copies)))

    def shutdown(self) -> None:
        if not self._finalizer.alive:
            return
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._finalizer()  # kills what did not stop, frees the shared memory

    # -- messages --------------------------------------------------------------------------
    def _call(self, msg: tuple) -> list:
        if self._dead:
            raise WorkerDiedError(self._dead)
        for rank, c in enumerate(self.conns):
            try:
                c.send(msg)
            except OSError:
                self._fail(self._gone(rank))
        return self._gather(timeout=None, what=msg[0])

    def _gather(self, timeout: float | None, what: str, ranks: list[int] | None = None) -> list:
        """One reply from every rank (or from `ranks`); the first death or error fails the
        executor, whichever rank it is."""
        replies: dict[int, Any] = {}
        ranks = list(range(self.world_size)) if ranks is None else ranks
        index = {c: r for r, c in enumerate(self.conns)}
        while len(replies) < len(ranks):
            ready = wait([c for r, c in enumerate(self.conns) if r not in replies], timeout)
            if not ready:
                self._fail(f"the tensor-parallel workers did not {what} within {timeout:.0f} s")
            for c in ready:
                rank = index[c]
                try:
                    kind, payload = c.recv()
                except (EOFError, OSError):
                    self._fail(self._gone(rank))
                if kind == "error":
                    tb, user_error = payload
                    if user_error is not None:  # a KilnError (a bad checkpoint, ...): its one sentence
                        self._fail(str(user_error), user_error)
                    self._fail(f"tensor-parallel worker {rank} failed:\n{tb}")
                if rank not in ranks:  # a rank that spoke out of turn: only an error may
                    self._fail(f"tensor-parallel worker {rank} sent {kind!r} while the executor waited "
                               f"for rank {ranks} to {what}")
                replies[rank] = payload
        return [replies[r] for r in ranks]

    def _gone(self, rank: int) -> str:
        p = self.procs[rank]
        try:
            code = p.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        how = (f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit code {code}")
        return f"tensor-parallel worker {rank} (pid {p.pid}) died ({how})"

    def _fail(self, message: str, error: BaseException | None = None) -> None:
        self._dead = message
        self._finalizer()
        raise error if error is not None else WorkerDiedError(message)
