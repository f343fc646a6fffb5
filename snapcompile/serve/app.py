"""The FastAPI application: routes, authentication, admission control and error shapes.

Route functions only parse, check and hand over to `OpenAIServing`; the engine is loaded on a
worker thread after the server starts, so `/health` answers 503 until the graphs are loaded.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from snapcompile.config import DEFAULT_SESSION_KEEP
from snapcompile.engine.loop import EngineLoop, Reporters
from snapcompile.prompts import read_chat_template, set_chat_template
from snapcompile.serve import protocol
from snapcompile.serve.bodies import BodyParser, max_values
from snapcompile.serve.bounds import MAX_WAITING, ServerLimits
from snapcompile.serve.completions import OpenAIServing, check_model
from snapcompile.serve.limits import PeerBudget, PeerRequests, read_json_body
from snapcompile.serve.metrics import CONTENT_TYPE, Metrics
from snapcompile.serve.partitions import cache_partition
from snapcompile.serve.protocol import ApiError, ChatRequest, CompletionRequest, now, parse
from snapcompile.serve.throughput_log import ThroughputLog
from snapcompile.serve.tokenizer_pool import TokenizerPool

log = logging.getLogger("snapcompile.serve")
RETRY_AFTER_S = 1


@dataclass
class ServerSettings:
    artifact: Path
    model_name: str                     # the name responses and /v1/models give first
    api_key: str | None = None
    max_waiting: int | None = MAX_WAITING   # 429 beyond this many requests waiting for a slot (None: no bound)
    slots: int | None = None            # use at most this many of the artifact's static slots
    backend: str = "ort"
    limits: ServerLimits = field(default_factory=ServerLimits)
    prefill_tokens_per_step: int | None = None   # prompt tokens between two decode steps (None: one chunk)
    session_cache_bytes: int | None = None       # kept conversations' caches (None: sized at load; 0: off)
    session_keep: str = DEFAULT_SESSION_KEEP     # what the store keeps of a compressed sequence (Engine)
    session_sharing: str = "private"               # who shares kept caches without a key or salt (partition_of)
    aliases: tuple[str, ...] = ()                  # more names clients may send (--served-model-name repeated)
    allowed_origins: tuple[str, ...] = ()          # browser origins CORS allows (--allowed-origins; none: off)
    chat_template: Path | None = None              # a Jinja file replacing the artifact's (--chat-template)
    reasoning_parser: str | None = None            # serve.reasoning.PARSERS (--reasoning-parser; None: off)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *(name for name in self.aliases if name != self.model_name))


@dataclass
class ServerState:
    """What the routes read: the engine once loaded, and whether the server is draining."""

    settings: ServerSettings
    metrics: Metrics = field(default_factory=Metrics)
    partition_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))   # this process's, never shown
    peer_requests: PeerBudget = field(init=False)       # engine requests in flight per client address
    serving: OpenAIServing | None = None
    engine_loop: EngineLoop | None = None
    tokenizers: TokenizerPool | None = None
    bodies: BodyParser | None = None
    draining: bool = False
    load_error: str | None = None

    def __post_init__(self) -> None:
        self.peer_requests = PeerBudget(self.settings.limits.max_requests_per_client)

    def close(self) -> None:
        """Stop the engine thread and the worker processes (tokenizers, large bodies)."""
        if self.engine_loop is not None:
            self.engine_loop.stop()
        for workers in (self.tokenizers, self.bodies):
            if workers is not None:
                workers.close()

    @property
    def engine_failed(self) -> str | None:
        """Why the engine thread stopped, once it has (the server then exits non-zero)."""
        return self.engine_loop.failed if self.engine_loop is not None else None

    @property
    def status(self) -> str:
        if self.engine_failed:
            return "failed"
        if self.draining:
            return "draining"
        return "ok" if self.serving is not None else ("failed" if self.load_error else "loading")


def load_engine(state: ServerState) -> None:
    """Open the artifact and start the engine thread (runs on a worker thread)."""
    from snapcompile.engine.engine import Engine
    settings = state.settings
    engine = Engine.from_artifact(settings.artifact, backend=settings.backend, max_slots=settings.slots,
                                  prefill_tokens_per_step=settings.prefill_tokens_per_step,
                                  session_cache_bytes=settings.session_cache_bytes,
                                  session_keep=settings.session_keep)
    engine.backend.make_graphs()                  # ready means no request waits for a graph to be made
    state.metrics.set_totals(engine.scheduler.pool.num_slots, engine.kv_bytes_allocated())
    engine_loop = EngineLoop(engine, Reporters(state.metrics, ThroughputLog(engine.scheduler.pool.num_slots)))
    engine_loop.start()
    export = engine.backend.manifest.export
    state.engine_loop = engine_loop
    if settings.chat_template is not None:
        set_chat_template(engine.tokenizer, read_chat_template(settings.chat_template))
    state.tokenizers = TokenizerPool(settings.artifact, settings.limits.tokenizer_workers,
                                     settings.limits.render_timeout_s, chat_template=settings.chat_template)
    state.bodies = BodyParser(max_values(settings.limits.max_prompts, engine.prompt_limit),
                              timeout_s=settings.limits.body_timeout_s)
    state.serving = OpenAIServing(engine_loop, engine.tokenizer, settings.model_names,
                                  max(export.max_context, engine.prompt_limit + 1),
                                  state.tokenizers, settings.limits.max_prompts, settings.reasoning_parser)


def create_app(state: ServerState) -> FastAPI:
    # redirect_slashes off: /v1/completions/ is an unknown route (404 in OpenAI's shape), not a 307
    app = FastAPI(title="snapcompile", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.state.server = state
    app.add_middleware(PeerRequests, budget=state.peer_requests)
    if state.settings.allowed_origins:         # outermost: a preflight is answered before anything else
        app.add_middleware(CORSMiddleware, allow_origins=list(state.settings.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"],
                           allow_credentials=False, max_age=600)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        if err.status in (400, 404, 408, 413, 415, 429, 503):
            state.metrics.rejected()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        """Unknown routes (404) and methods (405) in OpenAI's error shape too."""
        message = "no such route" if err.status_code == 404 else str(err.detail)
        return JSONResponse(ApiError(err.status_code, message).body(), status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(ApiError(500, "internal error").body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": state.status}, status_code=200 if state.status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _authenticate(request, state.settings.api_key)
        return JSONResponse({"object": "list", "data": [_model_card(name) for name in state.settings.model_names]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        _authenticate(request, state.settings.api_key)
        check_model(model_id, state.settings.model_names)
        return JSONResponse(_model_card(model_id))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _complete(state, request, "chat", ChatRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(state, request, "completion", CompletionRequest)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        serving, params = await _accept_body(state, request, protocol.TokenizeRequest)
        return JSONResponse(await serving.tokenize(params))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        serving, params = await _accept_body(state, request, protocol.DetokenizeRequest)
        return JSONResponse(await serving.detokenize(params))

    return app


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": now(), "owned_by": "snapcompile"}


async def _accept_body(state: ServerState, request: Request, model):
    """The authenticated, ready server's OpenAIServing and the request's body as `model`."""
    _authenticate(request, state.settings.api_key)
    serving = _ready(state)
    body = await read_json_body(request, state.settings.limits, state.bodies)
    return serving, await asyncio.to_thread(parse, model, body)


async def _complete(state: ServerState, request: Request, kind: str, model):
    serving, params = await _accept_body(state, request, model)
    call = await serving.accept(kind, params, partition_of(state, params.cache_salt))
    _admit(state, len(call.requests))
    PeerRequests.hold(state.peer_requests, request, len(call.requests))
    if call.params.stream:
        return StreamingResponse(serving.stream(call), media_type="text/event-stream")
    return JSONResponse(await serving.complete(call, request.is_disconnected))


def partition_of(state: ServerState, cache_salt: str | None) -> str | None:
    """The session-store partition of an authenticated request (serve.partitions.cache_partition)."""
    return cache_partition(state.partition_secret, cache_salt, state.settings.api_key is not None,
                       state.settings.session_sharing)


def _authenticate(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise ApiError(401, "missing or wrong API key (send it as: Authorization: Bearer KEY)", code="invalid_api_key")


def _ready(state: ServerState) -> OpenAIServing:
    if state.engine_failed:
        raise ApiError(503, "the engine has failed; the server is stopping")
    if state.draining:
        raise ApiError(503, "the server is shutting down", headers={"Retry-After": str(RETRY_AFTER_S)})
    if state.serving is None:
        raise ApiError(503, "the model is still loading", headers={"Retry-After": str(RETRY_AFTER_S)})
    return state.serving


def _admit(state: ServerState, prompts: int) -> None:
    """429 when the `prompts` new engine requests would pass --max-waiting (400 when they alone do)."""
    limit = state.settings.max_waiting
    if limit is None:
        return
    if 0 < limit < prompts:
        raise ApiError(400, f"{prompts} prompts in one request: more than --max-waiting ({limit})", param="prompt")
    if state.engine_loop.waiting + prompts > limit:
        raise ApiError(429, f"{limit} requests are already waiting for a slot; retry later",
                       headers={"Retry-After": str(RETRY_AFTER_S)})


async def drain(state: ServerState, timeout_s: float, poll_s: float = 0.1) -> int:
    """Refuse new requests and wait up to `timeout_s` for the running ones to finish; abort the
    rest. Returns how many were aborted."""
    state.draining = True
    engine_loop = state.engine_loop
    if engine_loop is None:
        return 0
    deadline = asyncio.get_running_loop().time() + timeout_s
    while engine_loop.active and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(poll_s)
    left = engine_loop.active
    if left:
        log.warning("drain timeout: aborting %d unfinished requests", left)
        for request_id in engine_loop.running_ids():
            engine_loop.abort(request_id)
        await asyncio.sleep(poll_s * 5)
    return left
