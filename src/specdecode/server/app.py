"""The FastAPI app: OpenAI and Anthropic routes over one LLM, plus /health and /metrics.

`create_app(llm, ...)` builds everything around one loaded `LLM`: a single
generation worker with a bounded queue, the guard middleware (API key, body
size), error handlers in each API's shape, and Prometheus metrics.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request, Response

from specdecode.llm import LLM
from specdecode.prefix_store import PrefixStore
from specdecode.server import anthropic_routes, openai_routes
from specdecode.server.errors import install_handlers
from specdecode.server.generation import ServerContext
from specdecode.server.guard import Guard
from specdecode.server.metrics import Metrics
from specdecode.server.worker import Worker

MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_SECONDS = 20.0
PREFIX_STORE_MB = 2048  # as llama-server's prompt cache in RAM, a quarter of its 8 GiB


def default_model_name(llm: LLM) -> str:
    """The target's file (or folder) name without its extension."""
    target = llm.info.target
    return Path(target).stem if target and target != "?" else "specdecode"


def create_app(
    llm: LLM,
    *,
    api_key: str | None = None,
    max_queue: int = 16,
    model_name: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout: float = BODY_TIMEOUT_SECONDS,
    prefix_store_mb: int = PREFIX_STORE_MB,
) -> FastAPI:
    """An ASGI app serving `llm`.

    api_key: required on every route but /health (None: no auth).
    max_queue: requests that may wait while one generates; more get a 429.
    model_name: the name clients send as `model` (also accepted: "default").
    max_body_bytes: larger request bodies get a 413.
    body_timeout: seconds to receive a whole request body, else a 408.
    prefix_store_mb: memory for earlier conversations' caches, so users taking turns
    each resume their own without a prefill (prefix_store.py; 0: off).
    `app.state.ctx.worker.drain(seconds)` starts a graceful shutdown (see Worker.drain).
    """
    metrics = Metrics()
    decoder = getattr(llm, "decoder", None)
    if decoder is not None and prefix_store_mb and decoder.prefix_store is None:
        decoder.prefix_store = PrefixStore(prefix_store_mb << 20)
    metrics.watch_prefix_store(getattr(decoder, "prefix_store", None))
    metrics.watch_suffix_store(getattr(getattr(llm, "decoder", None), "drafters", ()))
    metrics.watch_guard(getattr(getattr(llm, "decoder", None), "controller", None))
    worker = Worker(llm, max_queue=max_queue, metrics=metrics)
    ctx = ServerContext(llm, worker, metrics, model_name or default_model_name(llm))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="specdecode", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ctx = ctx
    install_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        return {"status": "ok", "model": ctx.model_name, "in_flight": worker.in_flight,
                "waiting": worker.waiting, "max_queue": worker.max_queue}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics,
                       body_timeout=body_timeout)
    return app
