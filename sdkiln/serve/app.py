"""The HTTP side of ``sdkiln serve``: a FastAPI app over an ``Engine`` (``docs/serving.md``).

``POST /v1/images/generations`` (OpenAI's images API plus sdkiln's fields, ``serve.requests``),
``GET /v1/models``, ``GET /health`` (503 while draining),
``GET /metrics`` (Prometheus text). Every error is OpenAI's error object with the status that fits:
400 for a bad body (naming the field), 404 for an unknown model or route, 413 for a body over
``max_body`` bytes, 429 with ``Retry-After`` for a full queue, 504 past ``request_timeout`` and 499 (not
delivered) for a client that left (the work is dropped either way), 500 for a failed generation (the
server keeps serving), 503 while draining. A request is one log line: id,
status, size, images, batch, seconds."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sdkiln.serve.engine import Engine
from sdkiln.serve.requests import ApiError, Limits, parse_body

log = logging.getLogger("sdkiln.serve")


class State:
    """What the handlers share: readiness and the served model's ids."""

    def __init__(self, engine: Engine, limits: Limits, request_timeout_s: float, max_body: int, created: int):
        self.engine, self.limits = engine, limits
        self.request_timeout_s, self.max_body, self.created = request_timeout_s, max_body, created
        self.ready = False
        self.draining = False


def create_app(state: State, lifespan=None) -> FastAPI:
    app = FastAPI(title="sdkiln serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    engine, metrics = state.engine, state.engine.metrics

    def error_response(exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(ApiError(exc.status_code, message, kind=kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        metrics.error("internal")
        metrics.request(500)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"))

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok", "queue": len(engine.queue)}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": mid, "object": "model", "created": state.created, "owned_by": "sdkiln"}
                for mid in state.limits.model_ids
            ],
        }

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/images/generations")
    async def generations(request: Request):
        started = time.monotonic()
        job, parsed = None, None
        try:
            if state.draining:
                raise ApiError(503, "the server is shutting down", kind="server_error", code="shutting_down")
            if not state.ready:
                raise ApiError(503, "the server is not ready", kind="server_error", code="not_ready")
            raw = await _read_body(request, state.max_body)
            parsed = parse_body(raw, state.limits)
            job = engine.submit(parsed)
            images = await _answer(request, job, state)
        except ApiError as exc:
            if exc.status in (400, 404, 413):
                metrics.error("invalid_request")
            seconds = time.monotonic() - started
            metrics.request(exc.status, seconds if exc.status in (500, 504) else None)
            _log(job, parsed, exc.status, seconds, exc.message)
            return error_response(exc)
        seconds = time.monotonic() - started
        metrics.request(200, seconds)
        _log(job, parsed, 200, seconds)
        return {
            "created": int(time.time()),
            "data": [
                {"b64_json": b64, "revised_prompt": None, "seed": parsed.seed + i}
                for i, b64 in enumerate(images)
            ],
        }

    return app


async def _answer(request: Request, job, state: State) -> list[str]:
    """The job's images, racing its future against the request timeout and the client's disconnect
    (uvicorn never cancels a handler whose client left: it only reports ``http.disconnect``)."""
    engine, metrics = state.engine, state.engine.metrics
    future = asyncio.wrap_future(job.future)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait(
            {future, watcher}, timeout=state.request_timeout_s, return_when="FIRST_COMPLETED"
        )
    finally:
        watcher.cancel()
    if future in done:
        return future.result()  # the images, or the ApiError the engine settled it with
    engine.drop(job)
    future.cancel()
    if watcher in done:
        metrics.error("disconnected")
        raise ApiError(499, "the client closed the connection; the work was dropped", code="client_closed")
    metrics.error("timeout")
    raise ApiError(
        504,
        f"the request took longer than the server's request timeout ({state.request_timeout_s:g} s); "
        "its work was dropped",
        kind="timeout_error",
        code="timeout",
    )


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or ApiError(413) once it passes ``limit`` bytes (by its Content-Length or as it streams)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body is {declared} bytes; this server takes at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the body is over {limit} bytes, the most this server takes")
        chunks.append(chunk)
    return b"".join(chunks)


def _log(job, request: Any, status: int, seconds: float, error: str | None = None) -> None:
    """One line per request: id, status, size, images, batch, seconds (and the error)."""
    rid = job.id if job is not None else "-"
    size = f"{request.width}x{request.height}" if request is not None else "-"
    n = request.n if request is not None else "-"
    batch = job.batch if job is not None and job.batch else "-"
    line = f"{rid} {status} size={size} n={n} batch={batch} {seconds:.3f}s"
    log.info(line + (f" error={error[:200]!r}" if error else ""))
