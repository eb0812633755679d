"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the server makes goes through `APIError`, so the status code, the error type and
the body shape have one home (the `openai` client raises BadRequestError, AuthenticationError,
... from the status and reads ``error.message``)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.responses import Response

# status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code or str(self.status)}}

    def response(self, headers: dict[str, str] | None = None) -> Response:
        return Response(json.dumps(self.body()), status_code=self.status, media_type="application/json",
                        headers=headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def server_stopping() -> APIError:
    """The answer to every request still in flight when the server stops now (a second SIGTERM,
    or SIGINT): the request was aborted, another replica can take it."""
    return APIError(503, "the server is stopping now (a second SIGTERM, or SIGINT): the request was aborted; "
                         "retry on another replica", code="server_stopping")
