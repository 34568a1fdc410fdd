"""A tensor-parallel worker process: `python -m kiln.runtime.worker.tp_worker FD`
(runtime/worker/multiproc_executor.py starts it; FD is its end of a socket to the executor).

It receives ("init", make_worker, rank, world size, shm handle, nccl), attaches to the group's
shared memory (CPU ranks) or joins the NCCL bootstrap (GPU ranks: rank 0 makes the unique id
and sends ("nccl_id", id) up, the others receive it from the executor), builds its rank's
executor with make_worker(rank, communicator or NcclBootstrap), says ("ready", sizes), then
serves ("execute", inputs) / ("copy", state-slot copies) / ("stop",) until told to stop or
until its executor goes away (EOF: it exits, so no worker outlives its engine). Any failure is
sent back as ("error", traceback) and the worker exits; the executor then fails the engine.
"""
from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Connection


def serve(conn: Connection) -> int:
    from kiln.runtime.worker.shm_communicator import ShmCommunicator

    comm = None
    try:
        kind, make_worker, rank, world_size, handle, nccl = conn.recv()
        if nccl:
            from kiln.runtime.worker.nccl import NcclBootstrap, NcclLibrary

            if rank == 0:
                uid = NcclLibrary().unique_id()
                conn.send(("nccl_id", uid))
            else:
                kind, uid = conn.recv()
            ex = make_worker(rank, NcclBootstrap(uid, world_size, rank))
        else:
            comm = ShmCommunicator(handle, rank)
            ex = make_worker(rank, comm)
        info = {"num_blocks": ex.num_blocks, "num_state_slots": ex.num_state_slots}
        if hasattr(ex, "buckets"):  # a GPU executor's plans: the engine sizes logits rows by them
            info["buckets"] = [{k: p[k] for k in ("tokens", "seqs", "logits", "decode")} for p in ex.buckets]
        conn.send(("ready", info))
        while True:
            msg = conn.recv()
            if msg[0] == "execute":
                out = ex.execute(msg[1])
                conn.send(("ok", out if rank == 0 else None))  # the logits come from rank 0 only
            elif msg[0] == "copy":
                ex.copy_state_slots(msg[1])
                conn.send(("ok", None))
            elif msg[0] == "stop":
                return 0
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        return 0  # the executor went away
    except BaseException as e:
        from kiln.errors import KilnError

        user = e if isinstance(e, KilnError) else None  # one sentence a user can act on: passed on as is
        try:
            conn.send(("error", (traceback.format_exc(limit=20), user)))
        except OSError:
            pass
        return 1
    finally:
        if comm is not None:
            comm.close()


if __name__ == "__main__":
    sys.exit(serve(Connection(int(sys.argv[1]))))
