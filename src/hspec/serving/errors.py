"""Every error the server answers, in OpenAI's envelope `{"error": {"message", "type", "param", "code"}}`.

The `openai` client reads `error.message`, so each message names the bad value and what is allowed.
Handlers here cover the server's own errors (`APIError`), request bodies that do not parse or
validate, Starlette's HTTP errors (unknown path, wrong method, body too large) and anything
unexpected (500, with a generic message: the traceback goes to the log), so no answer ever comes in
FastAPI's `{"detail": ...}` format.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from hspec.serving import protocol

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"; only logs and metrics see it

Body = TypeVar("Body", bound=BaseModel)


class APIError(Exception):
    """An error answered with `status` and OpenAI's error envelope."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers


class ClientGone(Exception):
    """The client disconnected while its request was being served."""


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, kind, param, code), status_code=status, headers=headers)


def parse_body(model: type[Body], raw: bytes) -> Body:
    """Decode, parse and validate a JSON request body; APIError 400 naming what is wrong.

    Runs in a worker thread (`app.py`): parsing a large body must not stall the event loop.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {err.start} is "
                            f"{raw[err.start:err.start + 1]!r}); send JSON encoded as UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise APIError(400, f"malformed JSON body: {err.msg} (line {err.lineno}, column {err.colno})") from None
    except ValueError as err:  # an integer literal over Python's 4,300-digit limit
        raise APIError(400, f"malformed JSON body: {err}") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: arrays and objects nested too deeply") from None
    if "\\ud" in text.lower():  # a \uD800-\uDFFF escape: valid only as half of a surrogate pair
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the request body has an unpaired UTF-16 surrogate escape (a \\uD800-\\uDFFF "
                                "that is not half of a high-low pair), which is no character") from None
    try:
        return model.model_validate(data)
    except ValidationError as err:
        message, param = validation_message(err.errors())
        raise APIError(400, message, param=param) from None
    except RecursionError:
        raise APIError(400, "invalid request: arrays and objects nested too deeply") from None


def validation_message(errors: Any) -> tuple[str, str | None]:
    """One readable line from pydantic's errors, and the first offending parameter."""
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        message = str(e.get("msg")).removeprefix("Value error, ")
        parts.append(f"{where}: {message}")
    return "invalid request: " + "; ".join(parts[:5]), param


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of `app` in OpenAI's envelope."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.kind, err.param, err.code, err.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_message(err.errors())
        return error_response(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException) -> JSONResponse:
        if err.status_code == 404:
            message = (f"no such path {request.url.path}; this server answers /v1/completions, "
                       "/v1/chat/completions, /v1/models, /health and /metrics")
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(err.detail)
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return error_response(err.status_code, message, kind, headers=err.headers)

    @app.exception_handler(ClientDisconnect)
    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; the request was cancelled

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, __: Exception) -> JSONResponse:
        # Starlette re-raises after this answer, so uvicorn logs the traceback; the client learns nothing
        # of the server's internals from it.
        return error_response(500, "internal server error (the server log has the details)", "server_error")
