"""PipeWriter: the front's sends to the engine core process, on a thread of their own.

Why (issue 42 #7): a multiprocessing Pipe is a socket pair holding ~230 KB each way. Under a
burst (3,000 streams, or n: 3000) the front wrote its adds with a blocking send while the
core, busy stepping, wrote step messages it was not reading: once both directions were full,
the front blocked in `send` (so it never read) and the core blocked in its own `send` (so it
never read either). Every client hung, forever.

Here `send` only pickles the message (on the caller's thread, so the message is the state the
caller saw) and queues the bytes; one thread writes them in order. The front's engine thread
therefore always gets back to reading, which unblocks the core, which then reads the queued
adds: no cycle of blocked writers can form, whatever the burst. The core keeps its blocking
sends on purpose: a front slower than the core then slows the core down (backpressure) rather
than growing a queue of step messages in the core without bound. The front's queue is bounded
by what its callers admit (requests and aborts, each sent once).
"""
from __future__ import annotations

import queue
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

_STOP = object()


class PipeWriter:
    def __init__(self, conn, name: str = "kiln-core-writer") -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: Optional[BaseException] = None  # what the write failed with (the core is gone)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, msg: Any) -> None:
        """Queue `msg` for the other end (as Connection.send would write it); never blocks on
        the pipe. Raises what an earlier write failed with."""
        if self.error is not None:
            raise self.error
        self._queue.put(bytes(ForkingPickler.dumps(msg)))

    def _run(self) -> None:
        while True:
            buf = self._queue.get()
            if buf is _STOP:
                return
            try:
                self._conn.send_bytes(buf)
            except (OSError, EOFError) as e:  # the core process is gone: the reader finds out too
                self.error = e
                return

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to `timeout` seconds), then stop the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
