"""The FastAPI app of one API process: OpenAI routes, auth, errors, /health and /metrics."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.engine.client import AsyncEngine
from tandem.server import protocol as p
from tandem.server.metrics import CONTENT_TYPE, ServerMetrics
from tandem.server.adapters import ServedAdapters
from tandem.server.playground import add_playground_routes
from tandem.server.protocol import ApiError
from tandem.server.security import ApiKeyMiddleware, cors_middleware_kwargs, public_message
from tandem.server.serving import OpenAIServing

logger = logging.getLogger(__name__)


def build_app(engine: AsyncEngine, tokenizer: Any, *, model_names: list[str], max_model_len: int,
              vocab_size: int, api_key: str | None = None, api_restarts: int = 0,
              tool_call_parser: str | None = None, public_metrics: bool = False,
              allowed_origins: list[str] | None = None, adapters: ServedAdapters | None = None) -> FastAPI:
    """An app in front of the engine core that `engine` talks to; it connects and disconnects with the app's lifespan.

    With `api_key`, every route but /health (and /metrics with `public_metrics`) needs it; CORS headers are
    sent only for `allowed_origins`. api_restarts: how many API processes the launcher has replaced so far
    (shown in /metrics).
    """
    metrics = ServerMetrics()
    metrics.api_server_restarts.set(api_restarts)
    serving = OpenAIServing(engine, tokenizer, metrics, model_names, max_model_len, vocab_size, tool_call_parser,
                            adapters)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown()
            if serving.encoder is not None:
                serving.encoder.close()

    app = FastAPI(title="tandem", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving
    add_playground_routes(app)
    # Added last is outermost: CORS answers preflights before the key check, which comes before any route.
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, public_metrics=public_metrics,
                           cors=bool(allowed_origins), on_reject=metrics.count_rejected)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, **cors_middleware_kwargs(allowed_origins))

    @app.post("/v1/completions", response_model=p.CompletionResponse,
              openapi_extra=_json_body(p.CompletionRequest))
    async def completions(request: Request) -> Response:
        return await serving.completions(await request.body(), request)

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse,
              openapi_extra=_json_body(p.ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(await request.body(), request)

    @app.get("/v1/models", response_model=p.ModelList)
    async def models() -> p.ModelList:
        return serving.models()

    @app.post("/v1/load_lora_adapter", openapi_extra=_json_body(p.LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> Response:
        return serving.load_lora_adapter(await request.body())

    @app.post("/v1/unload_lora_adapter", openapi_extra=_json_body(p.UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> Response:
        return serving.unload_lora_adapter(await request.body())

    @app.get("/health")
    async def health() -> Response:
        replicas = {"live": engine.num_live_replicas, "total": engine.num_replicas}
        down = [{"replica": r, "state": state, "reason": engine.replica_error[r]}
                for r, state in enumerate(engine.replica_state) if state != "live"]
        if engine.is_alive:  # 200 while one replica takes requests; "degraded" when some are out
            body: dict[str, Any] = {"status": "degraded" if down else "ok", "replicas": replicas}
            if down:
                body["down"] = down
            return JSONResponse(body)
        body = p.error_body(public_message(engine.error or "engine not running"), type="server_error", code=503)
        body.update(replicas=replicas, down=down)
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(engine.stats, engine.num_requests, engine.num_live_replicas,
                                       engine.num_replica_failures), media_type=CONTENT_TYPE)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        if exc.status != 499:
            metrics.count_rejected(exc.status)
        message = public_message(exc.message) if exc.status >= 500 else exc.message
        body = p.error_body(message, type=exc.type, param=exc.param, code=exc.code)
        return JSONResponse(body, status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        body = p.error_body(str(exc.detail), type="invalid_request_error", code=exc.status_code)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        # The traceback goes to the log; the body names no exception, path or line.
        logger.exception("unhandled error on %s", request.url.path)
        metrics.count_rejected(500)
        return JSONResponse(p.error_body("internal server error", type="server_error", code=500), status_code=500)

    return app


def _json_body(model: type) -> dict[str, Any]:
    """Documents a body the handler parses itself (so that bad JSON is a 400, not FastAPI's 422)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {k: v for k, v in schema.items() if k != "$defs"}}}}}
