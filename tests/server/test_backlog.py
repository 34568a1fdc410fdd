"""The listening socket's accept queue (--backlog, uvicorn's flag and default 2048): issue 42's
3,000-client burst lost 230 clients whose SYNs the kernel dropped past Tornado's default of 128.

Measured on the kernel: while nothing accepts (the server process stopped with SIGSTOP, or a
socket bound and never served), the kernel completes the handshake of at most backlog + 1
connections and drops the SYNs of the rest, which stay unconnected."""
from __future__ import annotations

import os
import selectors
import signal
import socket
import time

import pytest

from kiln.server.api_server import bind
from tests.server.test_shutdown import start

SOMAXCONN = int(open("/proc/sys/net/core/somaxconn").read())  # the kernel's cap on any backlog


def connects(port: int, count: int, wait: float = 1.5) -> int:
    """Open `count` non-blocking connections at once; -> how many the kernel completed within `wait` s
    (a dropped SYN is retransmitted only after 1 s, and dropped again while the queue stays full)."""
    sel = selectors.DefaultSelector()
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.setblocking(False)
            socks.append(s)
            if s.connect_ex(("127.0.0.1", port)) not in (0, 115):  # EINPROGRESS
                raise OSError("connect failed at once")
            sel.register(s, selectors.EVENT_WRITE)
        done = 0
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0 and done < count:
            for key, _ in sel.select(left):
                sel.unregister(key.fileobj)
                done += key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        return done
    finally:
        sel.close()
        for s in socks:
            s.close()


@pytest.mark.skipif(SOMAXCONN < 600, reason=f"net.core.somaxconn is {SOMAXCONN} here")
def test_default_backlog_takes_a_burst_past_128():
    (sock,) = bind("127.0.0.1", 0)  # what run_server binds with --backlog left at its default
    try:
        assert connects(sock.getsockname()[1], 600) == 600  # Tornado's 128 would take 129
    finally:
        sock.close()


@pytest.mark.skipif(SOMAXCONN < 300, reason=f"net.core.somaxconn is {SOMAXCONN} here")
def test_backlog_flag_reaches_the_socket(tiny_chat_dir):
    srv, port = start(tiny_chat_dir, "--backlog", "300")
    try:
        os.kill(srv.proc.pid, signal.SIGSTOP)  # the front process, which holds the socket, accepts nothing
        try:
            got = connects(port, 500)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert got == 301, got  # the kernel's queue: backlog + 1 (neither 129 nor 500)
    finally:
        assert srv.stop() == 0
