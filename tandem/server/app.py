"""The FastAPI app (OpenAI routes, auth, errors, /metrics) and the `tandem serve` command line."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import signal
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.server import protocol as p
from tandem.server.async_engine import AsyncEngine
from tandem.server.protocol import ApiError
from tandem.server.metrics import CONTENT_TYPE, ServerMetrics
from tandem.server.playground import add_playground_routes
from tandem.server.serving import OpenAIServing

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 1024
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_app(core: Any, *, model_names: list[str], api_key: str | None = None,
              max_queue: int = DEFAULT_MAX_QUEUE) -> FastAPI:
    """An app serving one EngineCore; the engine thread starts and stops with the app's lifespan."""
    engine = AsyncEngine(core, max_queue=max_queue)
    metrics = ServerMetrics()
    serving = OpenAIServing(engine, core.tokenizer, metrics, model_names, core.max_model_len,
                            core.model_config.vocab_size)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="tandem", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving
    add_playground_routes(app)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    @app.post("/v1/completions", response_model=p.CompletionResponse,
              openapi_extra=_json_body(p.CompletionRequest))
    async def completions(request: Request) -> Response:
        check_auth(request)
        return await serving.completions(await request.body(), request)

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse,
              openapi_extra=_json_body(p.ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        return await serving.chat(await request.body(), request)

    @app.get("/v1/models", response_model=p.ModelList)
    async def models(request: Request) -> p.ModelList:
        check_auth(request)
        return serving.models()

    @app.get("/health")
    async def health() -> Response:
        if engine.is_alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse(p.error_body(engine.error or "engine not running", type="server_error", code=503),
                            status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(engine.stats, engine.num_requests), media_type=CONTENT_TYPE)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        if exc.status != 499:
            metrics.requests_rejected.labels(status=str(exc.status)).inc()
        body = p.error_body(exc.message, type=exc.type, param=exc.param, code=exc.code)
        return JSONResponse(body, status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        body = p.error_body(str(exc.detail), type="invalid_request_error", code=exc.status_code)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(p.error_body(f"internal error: {exc!r}", type="server_error", code=500),
                            status_code=500)

    return app


def _json_body(model: type) -> dict[str, Any]:
    """Documents a body the handler parses itself (so that bad JSON is a 400, not FastAPI's 422)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {k: v for k, v in schema.items() if k != "$defs"}}}}}


# ---- command line ---------------------------------------------------------------------------------


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`tandem serve` flags: the server's own, then the engine's (shared with `tandem generate`)."""
    from tandem.cli import add_engine_args

    g = parser.add_argument_group("server")
    g.add_argument("--served-model-name", default=None, help="the name clients pass as `model`")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $TANDEM_API_KEY)")
    g.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="waiting + running requests at most; more get HTTP 429")
    g.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are cut")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(parser)
    parser.add_argument("--no-overlap", dest="sync", action="store_true", help="the same as --sync")


def engine_config_from_args(args: argparse.Namespace) -> Any:
    from tandem.cli import engine_kwargs
    from tandem.config import EngineConfig

    return EngineConfig(**engine_kwargs(args))


def model_names_from_args(args: argparse.Namespace) -> list[str]:
    """The served name first (--served-model-name, else the model's base name), then the --model string."""
    if args.model is None:
        names = [args.served_model_name or DEFAULT_MODEL_NAME]
    else:
        base = os.path.basename(os.path.normpath(args.model))
        names = [args.served_model_name or base, args.model]
    return list(dict.fromkeys(names))


def serve_main(args: argparse.Namespace) -> int:
    """`tandem serve`: loads the engine, serves until SIGTERM/SIGINT, exits 0 after a graceful shutdown."""
    import uvicorn

    from tandem.engine import EngineCore

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_queue < 1:
        raise SystemExit(f"--max-queue must be >= 1, got {args.max_queue}")
    try:
        core = EngineCore(engine_config_from_args(args))
    except ValueError as exc:
        raise SystemExit(f"tandem serve: {exc}") from exc
    app = build_app(core, model_names=model_names_from_args(args), api_key=args.api_key, max_queue=args.max_queue)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=args.graceful_timeout, lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it caught through the handler that was installed before it ran;
    # a no-op one there makes a graceful SIGTERM end in exit status 0 instead of death by signal.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        return 1
    logger.info("tandem serve: shut down cleanly")
    return 0
