"""/health answers 503 while the engine makes no progress (issue 42 #7: a deadlocked engine
process hung every client while /health said 200), and 200 again once it moves. The stall is
made by a step that waits on an event; the stall timeout is shortened to keep the test fast."""
from __future__ import annotations

import json
import threading
import time

from kiln.entrypoints.async_llm import AsyncLLM
from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer
from tests.server.tiny_chat_model import MODEL_NAME, tiny_engine_args


def test_health_is_503_while_the_engine_is_stalled(tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir))
    srv = LiveServer(engine, ServerConfig(served_model_names=(MODEL_NAME,)))
    release = threading.Event()
    step = engine.engine.step

    def stuck_step():
        release.wait(30)
        return step()

    try:
        engine.stall_timeout = 0.3
        time.sleep(0.5)  # idle longer than the timeout: idle is not stalled
        assert srv.request("GET", "/health")[0] == 200
        engine.engine.step = stuck_step
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
        done = threading.Thread(target=lambda: srv.request("POST", "/v1/completions", body), daemon=True)
        done.start()
        deadline = time.monotonic() + 10
        while (code := srv.request("GET", "/health"))[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert code[0] == 503 and json.loads(code[2])["error"]["code"] == "engine_stalled"
        release.set()
        done.join(10)
        assert not done.is_alive()
        assert srv.request("GET", "/health")[0] == 200
    finally:
        release.set()
        srv.stop()
        engine.shutdown()
