"""Run the app on a socket: `python build.py serve` and in-process test servers.

The engine loads first (blocking, timed), then the app listens; SIGINT/SIGTERM stop
the listener, close connections and shut the engine down. Port 0 takes a free port
from the OS; the port actually bound is printed and returned.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import tornado.httpserver
import tornado.netutil

from kiln.errors import ChatTemplateError, KilnError
from kiln.runtime.text.chat_template import compile_template
from kiln.server.app import make_app
from kiln.server.state import ServerConfig

# Tornado reads (and drops) bodies up to this size even when the app refuses them with 413,
# so a client that sends its whole body before reading still gets the answer; past it the
# connection closes mid-upload.
MIN_BODY_DRAIN_BYTES = 64 << 20


@dataclass
class ListeningServer:
    http_server: tornado.httpserver.HTTPServer
    port: int
    host: str

    async def close(self) -> None:
        self.http_server.stop()
        await self.http_server.close_all_connections()


def bind(host: str, port: int, backlog: int = ServerConfig.backlog) -> list:
    """The listening sockets, or one sentence: bound before the model loads, so a port in use is
    said at once (issue 42 #6: it was said after minutes of loading). backlog: the accept queue
    (--backlog; the kernel caps it at net.core.somaxconn). Tornado's default of 128 dropped the
    SYNs of a 3,000-client burst: 230 clients never connected (docs/BENCHMARKS.md, issue 42)."""
    try:
        return tornado.netutil.bind_sockets(port, host, backlog=backlog)
    except OSError as e:
        what = "the port is in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        raise KilnError(f"cannot listen on {host}:{port}: {what}") from None


def check_chat_template(template: Optional[str], whose: str) -> None:
    """A template that does not compile is found at start, not at the first request (issue 42 #12)."""
    if template is not None:
        try:
            compile_template(template)
        except ChatTemplateError as e:
            raise KilnError(f"{whose} chat template cannot be used: {e}") from None


def listen(app, config: ServerConfig, host: str, port: int, sockets: Optional[list] = None) -> ListeningServer:
    """Bind (unless `sockets` are bound already) and start serving on the running event loop."""
    sockets = sockets if sockets is not None else tornado.netutil.bind_sockets(port, host, backlog=config.backlog)
    server = tornado.httpserver.HTTPServer(app, max_body_size=max(4 * config.max_body_bytes, MIN_BODY_DRAIN_BYTES),
                                           idle_connection_timeout=3600)
    server.add_sockets(sockets)
    return ListeningServer(server, sockets[0].getsockname()[1], host)


async def serve(engine, config: ServerConfig, host: str, port: int, *, load_seconds: float = 0.0,
                stop: Optional[asyncio.Event] = None, sockets: Optional[list] = None) -> int:
    """Serve until `stop` is set, SIGINT/SIGTERM arrives or the engine dies; -> the exit code.

    Stopping (issue 42 "Faults") stops listening, answers new requests and /health with 503,
    lets the requests in flight finish for config.shutdown_timeout seconds, then aborts the
    rest (a stream's last frame is an error event) and returns 0. An engine that died (it
    raised inside a step) has already failed every request in flight: the server then stops
    at once and returns 1, as vLLM's API server exits when its engine dies."""
    app = make_app(engine, config)
    try:
        srv = listen(app, config, host, port, sockets)
    except OSError as e:
        engine.shutdown()
        raise KilnError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    print(f"[kiln] serving {', '.join(config.served_model_names)} on http://{host}:{srv.port} "
          f"(model loaded in {load_seconds:.1f} s; max_model_len {engine.max_model_len})", flush=True)
    state = app.state
    code = 0
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), ENGINE_WATCH_S)
            except asyncio.TimeoutError:
                pass
            if engine.errored:
                print(f"[kiln] the engine failed ({engine.dead_error!r}); stopping the server", file=sys.stderr,
                      flush=True)
                code = 1
                break
        state.draining = True  # new requests and /health: 503
        srv.http_server.stop()  # no new connections
        if code == 0:
            await _drain(state, config.shutdown_timeout)
        await _settle(state, 5.0)  # the requests' last frames go out
    finally:
        await srv.close()
        engine.shutdown()
        state.pool.shutdown(wait=False)
    print("[kiln] server stopped", file=sys.stderr, flush=True)
    return code


ENGINE_WATCH_S = 0.25  # how often serve() looks whether the engine died


async def _drain(state, timeout: float) -> None:
    """Let the requests in flight finish for `timeout` seconds, then abort the rest: each ends
    with an error (a 503, or an error event as a stream's last frame)."""
    deadline = time.monotonic() + timeout
    while state.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.active:
        print(f"[kiln] aborting {len(state.active)} request(s) still running after the {timeout:g} s shutdown "
              "timeout", file=sys.stderr, flush=True)
        for handler in list(state.active):
            handler.abort_for_shutdown()


async def _settle(state, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while state.active and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def run_server(args, config: ServerConfig, host: str, port: int, *, engine_process: bool = True) -> int:
    """Load the model named by EngineArgs `args`, then serve (blocking). The engine core runs
    in its own process unless engine_process is False (as vLLM: HTTP never starves a step)."""
    from kiln.entrypoints.async_llm import AsyncLLM

    # Warnings and errors (4xx/5xx access lines, engine failures) to stderr; 2xx stay quiet.
    logging.basicConfig(level=logging.WARNING, format="[kiln] %(levelname)s %(name)s: %(message)s")
    check_chat_template(config.chat_template, "the --chat-template")
    sockets = bind(host, port, config.backlog)
    try:
        t0 = time.perf_counter()
        engine = AsyncLLM.from_engine_args(args, engine_process=engine_process)
        load_s = time.perf_counter() - t0
        if config.chat_template is None and engine.tokenizer is not None:
            try:
                check_chat_template(engine.tokenizer.chat_template, "the model's")
            except KilnError:
                engine.shutdown()
                raise
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return asyncio.run(serve(engine, config, host, port, load_seconds=load_s, sockets=sockets))
