"""OpenAI-style API errors: an exception that carries its HTTP status and renders OpenAI's error body.

The official `openai` client reads `{"error": {"message", "type", "param", "code"}}` from a non-2xx response and
raises the matching `openai.APIStatusError` subclass (BadRequestError for 400, NotFoundError for 404, ...)."""

from __future__ import annotations

from typing import Any

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_type_for(status: int) -> str:
    """OpenAI's error `type` for an HTTP status (unlisted 4xx: invalid_request_error, anything else: internal)."""
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "invalid_request_error" if 400 <= status < 500 else "internal_server_error"


class OpenAIError(Exception):
    """An error answered to the client: `status` is the HTTP status, the rest goes into the error body."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type_for(status)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"OpenAIError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r})"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str = "Invalid API key: pass it as 'Authorization: Bearer <key>'") -> OpenAIError:
    return OpenAIError(401, message, "authentication_error", None, "invalid_api_key")


def not_found(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(404, message, "not_found_error", param, code)


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, "service_unavailable")


def internal(message: str) -> OpenAIError:
    return OpenAIError(500, message, "internal_server_error")


def from_status(status: int, message: str) -> OpenAIError:
    """An error with the type that fits `status`; a status outside 400..599 (e.g. 0, unset) becomes 500."""
    if not 400 <= status <= 599:
        status = 500
    return OpenAIError(status, message)
