"""GET /health (200 while the engine loop lives and makes progress, 503 once it has died or
while it is stalled) and GET /version."""
from __future__ import annotations

from kiln import __version__
from kiln.server.base_handler import BaseHandler
from kiln.server.errors import APIError


class HealthHandler(BaseHandler):
    async def get(self) -> None:
        engine = self.state.engine
        if self.state.draining:
            raise APIError(503, "The server is shutting down.", code="shutting_down")
        if not engine.is_running:
            raise APIError(503, "The engine has stopped; the server cannot serve requests.", code="engine_dead")
        stalled = getattr(engine, "stalled_for", 0.0)  # busy with no step done (AsyncLLM.stall_timeout)
        if stalled:
            raise APIError(503, f"The engine has made no progress for {stalled:.0f} s.", code="engine_stalled")
        self.set_status(200)
        self.finish()


class VersionHandler(BaseHandler):
    def get(self) -> None:
        self.write_json({"version": __version__})
