"""The endpoint's FastAPI app (imported when a server starts: FastAPI is an optional dependency).

No ``from __future__ import annotations`` here: FastAPI reads the handlers' ``Request`` annotations at runtime.
"""
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from esopt_mp.endpoint.protocol import RequestError


def build_app(server):
    """The FastAPI app: ``/e/{token}/v1/...`` (an episode's routes) and ``/v1/...`` (the member's, no episode)."""
    app = FastAPI(title="esopt_mp endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: RequestError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def chat(request: Request, token: str | None):
        try:
            status, body, streamed = await server.chat(token, await request.body(), request.headers)
        except RequestError as e:
            return error(e)
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
