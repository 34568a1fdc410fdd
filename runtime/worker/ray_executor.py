"""The tensor-parallel executor on Ray (vLLM's --distributed-executor-backend ray).

The same interface and workers as runtime/worker/multiproc_executor.py, but each rank is a Ray
actor, placed by a placement group with one bundle per rank ({"GPU": 1} on a GPU target,
{"CPU": 1} here), as vLLM's ray_utils.initialize_ray_cluster does; the engine core stays in
the calling process and drives the actors with one remote call per rank and step.

Collectives: on the CPU the ranks use the shared-memory group (runtime/worker/shm_communicator.py),
so they must share a host: the placement group is STRICT_PACK. Across nodes the collective is
NCCL on the GPU target (docs/TENSOR_PARALLEL.md); the placement group's strategy and the bundle
resources are the only things that change.

Ray is imported only here, only when asked for: a missing Ray is reported by kiln.loader in one
sentence. A dead actor (killed, or its node lost) raises RayActorError from the step: the
executor kills the other actors and raises WorkerDiedError, which ends the engine.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from kiln.runtime.worker.multiproc_executor import MakeWorker, WorkerDiedError
from kiln.runtime.worker.shm_communicator import ShmGroup


class _Rank:
    """The actor's body: one rank's executor over the shared-memory group."""

    def __init__(self, make_worker: MakeWorker, rank: int, handle) -> None:
        from kiln.runtime.worker.shm_communicator import ShmCommunicator

        self.rank = rank
        self.comm = ShmCommunicator(handle, rank, watch_parent=False)  # an actor's parent is Ray's raylet
        self.ex = make_worker(rank, self.comm)

    def info(self) -> dict:
        return {"num_blocks": self.ex.num_blocks, "num_state_slots": self.ex.num_state_slots, "pid": os.getpid()}

    def execute(self, inputs):
        out = self.ex.execute(inputs)
        return out if self.rank == 0 else None

    def copy_state_slots(self, copies) -> None:
        self.ex.copy_state_slots(copies)


class RayExecutor:
    def __init__(self, make_worker: MakeWorker, world_size: int, *, resource: str = "CPU",
                 start_timeout: float = 600.0) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():  # RAY_ADDRESS (an existing cluster) or a local one
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
        self._ray, self._remove_pg = ray, remove_placement_group
        self.world_size = world_size
        self.group = ShmGroup(world_size)
        self.pg = placement_group([{resource: 1}] * world_size, strategy="STRICT_PACK")
        self.actors: list = []
        self._dead: str | None = None
        try:
            ray.get(self.pg.ready(), timeout=start_timeout)
            cls = ray.remote(num_cpus=1 if resource == "CPU" else 0, num_gpus=1 if resource == "GPU" else 0)(_Rank)
            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                            placement_group_bundle_index=rank)
                self.actors.append(cls.options(scheduling_strategy=strategy).remote(make_worker, rank,
                                                                                   self.group.handle))
            infos = self._get([a.info.remote() for a in self.actors], timeout=start_timeout)
        except Exception as e:
            if isinstance(e, WorkerDiedError):
                raise
            self._cleanup()
            raise WorkerDiedError(f"the Ray workers did not start: {e}") from None
        self.pids = [i["pid"] for i in infos]
        self.num_blocks = infos[0]["num_blocks"]
        self.num_state_slots = infos[0]["num_state_slots"]

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = {k: np.asarray(v) for k, v in inputs.items()}
        return self._get([a.execute.remote(inputs) for a in self.actors])[0]

    def copy_state_slots(self, copies) -> None:
        if copies:
            self._get([a.copy_state_slots.remote(list(copies)) for a in self.actors])

    def _get(self, refs: list, timeout: float | None = None) -> list[Any]:
        if self._dead:
            raise WorkerDiedError(self._dead)
        ray = self._ray
        try:
            # wait for the first failure, not for rank order: a rank blocked in a collective on a
            # dead peer finishes only after that peer's error is seen
            pending, done = list(refs), {}
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
                if not ready:
                    raise TimeoutError(f"no answer from the Ray workers within {timeout:.0f} s")
                done[ready[0]] = ray.get(ready[0])
            return [done[r] for r in refs]
        except Exception as e:  # RayActorError (a dead actor), RayTaskError (a failed step), a timeout
            self._dead = f"a tensor-parallel Ray worker failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self._cleanup()
            raise WorkerDiedError(self._dead) from None

    def _cleanup(self) -> None:
        for a in self.actors:
            try:
                self._ray.kill(a)
            except Exception:
                pass
        self.actors = []
        try:
            self._remove_pg(self.pg)
        except Exception:
            pass
        self.group.close()

    def shutdown(self) -> None:
        if self.actors:
            self._cleanup()
