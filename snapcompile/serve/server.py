"""`snapcompile serve`: uvicorn running the app, the engine loaded in the background, and a
graceful drain on SIGTERM / Ctrl-C (a second signal stops at once)."""
from __future__ import annotations

import asyncio
import copy
import logging
import socket
import sys

import uvicorn

from snapcompile.errors import EngineFailure, SnapcompileError, first_line
from snapcompile.serve.app import ServerSettings, ServerState, create_app, drain, load_engine
from snapcompile.serve.limits import PeerBudget, RateLimitedLog, bounded_h11_protocol

log = logging.getLogger("snapcompile.serve")


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains (503 for new requests, running ones finish
    up to `drain_timeout_s`) before it stops, and whose second signal stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float):
        super().__init__(config)
        self.state, self.drain_timeout_s = state, drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self._load_task = self._loop.create_task(self._load())
        self._watch_task = self._loop.create_task(self._watch_engine())
        await super().startup(sockets)

    async def _watch_engine(self, poll_s: float = 0.2) -> None:
        """Stop the server (exit code non-zero) once the engine thread has failed; /health says
        503 meanwhile and the requests in flight have their error."""
        while not self.should_exit:
            if self.state.engine_failed:
                log.error("stopping: %s", self.state.engine_failed)
                await asyncio.sleep(poll_s)       # let the failed requests' responses go out
                self.should_exit = True
                return
            await asyncio.sleep(poll_s)

    async def _load(self) -> None:
        try:
            await asyncio.to_thread(load_engine, self.state)
            print(ready_line(self.state, self.config.host, self.config.port), file=sys.stderr, flush=True)
        except Exception as err:  # a user error (bad artifact, too little memory) or a bug: stop either way
            self.state.load_error = str(err) if isinstance(err, SnapcompileError) else first_line(err)
            log.error("cannot load %s: %s", self.state.settings.artifact, self.state.load_error)
            self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        """Not uvicorn's: it would re-raise the signal after shutdown, and a drained server exits 0."""
        if self._drain_task is not None or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self._drain_task = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        log.info("draining: new requests get 503; waiting up to %.0f s for %d running",
                 self.drain_timeout_s, self.state.engine_loop.active if self.state.engine_loop else 0)
        await drain(self.state, self.drain_timeout_s)
        self.should_exit = True


def serve(settings: ServerSettings, host: str, port: int, drain_timeout_s: float, log_level: str = "info") -> None:
    """Serve until a signal drains and stops the server; raises SnapcompileError when the artifact
    cannot be loaded or the address cannot be bound."""
    state = ServerState(settings)
    limits = settings.limits
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                            log_config=_log_config(log_level),
                            timeout_graceful_shutdown=5, lifespan="off",
                            http=bounded_h11_protocol(limits, PeerBudget(limits.max_connections_per_client)),
                            timeout_keep_alive=limits.keep_alive_s,
                            limit_concurrency=limits.max_connections,
                            proxy_headers=bool(limits.forwarded_allow_ips),
                            forwarded_allow_ips=limits.forwarded_allow_ips or None)
    logging.getLogger("asyncio").addFilter(RateLimitedLog("out of system resource"))
    server = DrainingServer(config, state, drain_timeout_s)
    _check_bindable(host, port)
    try:
        server.run()
    finally:
        state.close()
    if state.load_error is not None:
        raise SnapcompileError(f"cannot serve {settings.artifact}: {state.load_error}")
    if state.engine_failed is not None:
        raise EngineFailure(f"stopped serving {settings.artifact}: {state.engine_failed}")


def _log_config(log_level: str) -> dict:
    """uvicorn's logging configuration with snapcompile's own loggers (the request and throughput
    lines, draining) on its stderr handler at `log_level`."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["snapcompile"] = {"handlers": ["default"], "level": uvicorn.config.LOG_LEVELS[log_level],
                                        "propagate": False}
    return config


def _check_bindable(host: str, port: int) -> None:
    """One clear error line for an address in use or not available, before uvicorn tries."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as err:
        raise SnapcompileError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


def ready_line(state, host: str, port: int) -> str:
    """The line `serve` prints once it answers: the model, its cache policy and shapes, the session store, the URL."""
    engine = state.engine_loop.engine
    manifest, store = engine.backend.manifest, engine.sessions
    policy = manifest.policy
    cache = f"{policy.policy} B={policy.budget}" if policy.compressed else "dense"
    sessions = "no session store"
    if store is not None:
        partition = state.settings.session_sharing
        sessions = f"session store {store.max_bytes / 2**20:.0f} MiB ({engine.session_keep}, {partition})"
    return (f"ready: serving {state.settings.model_name} at http://{host}:{port}/v1 ({manifest.model_name}, {cache}, "
            f"{engine.scheduler.pool.num_slots} slots, max context {manifest.export.max_context}, {sessions})")
