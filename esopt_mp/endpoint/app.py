"""The endpoint's FastAPI app (imported when a server starts: FastAPI is an optional dependency).

No ``from __future__ import annotations`` here: FastAPI reads the handlers' ``Request`` annotations at runtime.
"""
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from esopt_mp.endpoint.protocol import RequestError, too_large


async def read_body(request: Request, cap: int) -> bytes:
    """The request's body, or :func:`too_large` as soon as it is known to exceed ``cap`` bytes: its declared
    Content-Length, else the bytes received so far (a chunked body); what is past the cap is never kept."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise too_large(cap)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise too_large(cap)
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(server):
    """The FastAPI app: ``/e/{token}/v1/...`` (an episode's routes) and ``/v1/...`` (the member's, no episode)."""
    app = FastAPI(title="esopt_mp endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: RequestError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def chat(request: Request, token: str | None):
        try:
            server.check_key(request.headers.get("authorization"))  # first: a stranger's body is never read
            raw = await read_body(request, server.cfg.max_body_bytes)
            status, body, streamed = await server.chat(token, raw, request.headers)
        except RequestError as e:
            return error(e)
        except ClientDisconnect:  # the client went (or missed endpoint.request_timeout_s): nobody reads a reply
            return Response(status_code=400)
        if streamed:
            return StreamingResponse(iter(body), media_type="text/event-stream")
        return JSONResponse(body, status_code=status)

    def models(request: Request, token: str | None, model: str | None = None):
        try:
            return JSONResponse(server.models(token, request.headers, model))
        except RequestError as e:
            return error(e)

    @app.post("/v1/chat/completions")
    async def plain_chat(request: Request):
        return await chat(request, None)

    @app.post("/e/{token}/v1/chat/completions")
    async def episode_chat(token: str, request: Request):
        return await chat(request, token)

    @app.get("/v1/models")
    async def plain_models(request: Request):
        return models(request, None)

    @app.get("/v1/models/{model}")
    async def plain_model(model: str, request: Request):
        return models(request, None, model)

    @app.get("/e/{token}/v1/models")
    async def episode_models(token: str, request: Request):
        return models(request, token)

    @app.get("/e/{token}/v1/models/{model}")
    async def episode_model(token: str, model: str, request: Request):
        return models(request, token, model)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # unknown path, wrong method: OpenAI-shaped
        return error(RequestError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # a fault of the endpoint's own: still OpenAI-shaped
        return error(RequestError(500, f"{type(exc).__name__}: {exc}", kind="server_error"))

    return app
