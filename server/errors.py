"""Errors as the OpenAI API reports them: a status and
{"error": {"message", "type", "param", "code"}}.

`type` follows OpenAI's values (invalid_request_error for 4xx, server_error for 5xx);
`code` is OpenAI's string code where it has one (invalid_api_key, model_not_found,
context_length_exceeded, ...) and null otherwise; `param` names the request field at
fault. A message is always one sentence a user can act on, never a traceback.
"""
from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any, Optional

import tornado.web


class APIError(tornado.web.HTTPError):
    """Raised anywhere in a handler, it becomes the response (BaseHandler.write_error)."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(int(status), reason=HTTPStatus(int(status)).phrase)
        self.headers = headers or {}  # sent with the error (Retry-After on a 503)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def error_json(err: APIError) -> str:
    return json.dumps(err.body())


STATUS_CODES = {  # OpenAI-style codes for errors raised by the HTTP layer itself
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}


def http_error(status: int, message: Optional[str] = None) -> APIError:
    """An error for a bare HTTP status (routing, methods, body size)."""
    return APIError(status, message or f"{HTTPStatus(status).phrase}.", code=STATUS_CODES.get(status))
