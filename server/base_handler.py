"""The handler every route shares: JSON errors in OpenAI's shape, API-key checks,
a request-body limit, and knowing when the client went away.

Bodies are streamed in (`stream_request_body`) so an oversized one is never
buffered: past the limit the rest is read and dropped, then answered with 413. Any exception becomes a JSON error body: an APIError says
what it says, anything else is a 500 with one generic sentence (the traceback goes
to the server log, never to the client).
"""
from __future__ import annotations

import hmac
import json
import logging
from typing import Any, Callable, Optional

import tornado.web

from kiln.server.errors import APIError, http_error
from kiln.server.protocol import parse_json_body

logger = logging.getLogger("kiln.server")


@tornado.web.stream_request_body
class BaseHandler(tornado.web.RequestHandler):
    requires_auth = False  # True for the model endpoints (/v1/*, /tokenize, /detokenize)

    def initialize(self, state) -> None:
        self.state = state
        self._chunks: list[bytes] = []
        self._body_size = 0
        self._too_large = False
        self._declared_size: Optional[int] = None
        self.client_gone = False
        self._close_callbacks: list[Callable[[], None]] = []

    # ------------------------------------------------------------ request side

    def prepare(self) -> None:
        if self.requires_auth and self.state.config.api_key is not None and not self._authorized():
            raise APIError(401, "Incorrect or missing API key; send it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
        length = self.request.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > self.state.config.max_body_bytes:
            # Refused once the body is read (and dropped): answering now would make Tornado close
            # the connection under a client still sending, which then never reads the 413.
            self._too_large, self._declared_size = True, int(length)

    def _authorized(self) -> bool:
        auth = self.request.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode(), self.state.config.api_key.encode())

    def _too_large_error(self, size: Optional[int] = None) -> APIError:
        limit = self.state.config.max_body_bytes
        has = f"has {size} bytes" if size is not None else "is larger than that"
        return APIError(413, f"The request body {has}; the limit is {limit} bytes.", code="request_too_large")

    def data_received(self, chunk: bytes) -> None:
        if self._finished or self._too_large:
            return
        self._body_size += len(chunk)
        if self._body_size > self.state.config.max_body_bytes:
            self._too_large, self._chunks = True, []
            return
        self._chunks.append(chunk)

    def json_body(self) -> dict[str, Any]:
        if self._too_large:
            raise self._too_large_error(self._declared_size)
        self._check_content_type()
        return parse_json_body(b"".join(self._chunks))

    async def read_json(self) -> dict[str, Any]:
        """json_body(), parsed on a worker thread when the body is large (issue 42 #10)."""
        if self._too_large:
            raise self._too_large_error(self._declared_size)
        self._check_content_type()
        raw = b"".join(self._chunks)
        self._chunks = []
        return await self.state.run_sized(len(raw), parse_json_body, raw)

    def _check_content_type(self) -> None:
        """A body declared as something other than JSON is a 415 (as vLLM's validate_json_request;
        issue 42 #12: the header was ignored). No Content-Type at all is read as JSON."""
        ctype = self.request.headers.get("Content-Type")
        if ctype is None:
            return
        media = ctype.split(";", 1)[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            raise APIError(415, f"Unsupported Content-Type {ctype[:60]!r}; send the body as application/json.",
                           code="unsupported_media_type")

    # ------------------------------------------------------------ response side

    def write_json(self, obj: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(obj, ensure_ascii=False))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, APIError):
            err = exc
        elif isinstance(exc, tornado.web.HTTPError) and status_code < 500:
            err = self._http_error(status_code)
        else:
            err = APIError(500, "Internal server error; the server log has the details.")
        if err.status == 405:
            self.set_header("Allow", ", ".join(self.allowed_methods()))
        for name, value in err.headers.items():
            self.set_header(name, value)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(err.body()))

    def _http_error(self, status: int) -> APIError:
        if status == 404:
            return http_error(404, f"Not found: {self.request.path}.")
        if status == 405:
            return http_error(405, f"Method {self.request.method} is not allowed on {self.request.path}; "
                                   f"use {' or '.join(self.allowed_methods())}.")
        return http_error(status)

    def allowed_methods(self) -> list[str]:
        return [m for m in ("GET", "POST", "PUT", "DELETE", "PATCH")
                if getattr(type(self), m.lower()) is not getattr(tornado.web.RequestHandler, m.lower())]

    def log_exception(self, typ, value, tb) -> None:
        if isinstance(value, APIError):  # a client's mistake: one line, no traceback
            logger.info("%s %s -> %d: %s", self.request.method, self.request.path, value.status, value.message)
            return
        super().log_exception(typ, value, tb)

    # ------------------------------------------------------------ the client going away

    def on_close(self, callback: Callable[[], None]) -> None:
        """Run callback if the client disconnects before the response is finished."""
        if self.client_gone:
            callback()
        else:
            self._close_callbacks.append(callback)

    def on_connection_close(self) -> None:
        self.client_gone = True
        callbacks, self._close_callbacks = self._close_callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:
                logger.exception("disconnect callback failed")


class NotFoundHandler(BaseHandler):
    """Every unknown route: 404 for any method."""

    def prepare(self) -> None:
        raise http_error(404, f"Not found: {self.request.path}.")
