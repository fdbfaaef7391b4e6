"""One error shape for every control-plane app: OpenAI's {"error": {...}}."""

from __future__ import annotations

import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException

from ascendserve.protocol.openai import APIError, error_body

log = structlog.get_logger("ascendserve.web")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error"}


def _response(status: int, body: dict) -> Response:
    return Response(body, status_code=status, media_type="application/json")


def api_error(_: Request, exc: APIError) -> Response:
    return _response(exc.status, exc.body())


def http_error(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    message = exc.detail if isinstance(exc.detail, str) and exc.detail else "request failed"
    if status == 413:
        message = "request body too large"
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return _response(status, error_body(message, kind, None, str(status)))


def internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", path=request.url.path)
    return _response(500, error_body("internal error", "server_error", None, "500"))


EXCEPTION_HANDLERS = {APIError: api_error, HTTPException: http_error, Exception: internal_error}
