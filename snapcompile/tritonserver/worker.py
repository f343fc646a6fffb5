"""Triton requests -> the engine -> Triton responses, inside the Python backend's stub process.

`TritonWorker` owns an `EngineLoop` (the engine on its own thread). `execute` hands each request
over and returns at once (decoupled model); updates come back on the engine thread and go out
through the request's response sender: one response with the whole text when `stream` is false
(Triton's `generate` endpoint), or one per new text when true (`generate_stream`), the last one
flagged final. A cancelled request (`is_cancelled()`) is aborted: its slot is free within a step.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from snapcompile.config import DEFAULT_SESSION_KEEP
from snapcompile.engine.loop import EngineLoop, Update
from snapcompile.engine.request import Request, SamplingParams, logit_bias_pairs
from snapcompile.errors import JsonTooDeep, PromptError, SnapcompileError, check_text, first_line, parse_json
from snapcompile.prompts import encode_prompt, max_prompt_chars
from snapcompile.serve.metrics import Metrics
from snapcompile.serve.partitions import cache_partition

FLOAT_INPUTS = (("temperature", 0.0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                ("presence_penalty", 0.0), ("frequency_penalty", 0.0))   # SamplingParams' defaults
MAX_LOGIT_BIAS_CHARS = 64 * 1024

log = logging.getLogger("snapcompile.tritonserver")
CANCEL_POLL_S = 0.1
DEFAULT_MAX_TOKENS = 16
_ids = itertools.count()


@dataclass
class _Pending:
    """A request in flight: its sender, whether it streams, and the text sent so far."""

    request: object             # the Triton request (for is_cancelled)
    sender: object
    stream: bool
    chunks: list[str] = field(default_factory=list)


class TritonWorker:
    def __init__(self, pb_utils, artifact: Path, fingerprint: str, slots: int | None, backend: str = "ort",
                 threads: int | None = None, session_cache_bytes: int | None = None,
                 session_keep: str = DEFAULT_SESSION_KEEP, session_sharing: str = "private"):
        """pb_utils: the Python backend's `triton_python_backend_utils` module. threads: ONNX Runtime
        intra-op threads of this instance (default: all cores; size K instances x threads to the cores).
        session_cache_bytes: this instance's store of kept conversations (None: sized at load; 0: off);
        session_keep: what it keeps of a compressed sequence (Engine); session_sharing: who shares kept
        caches without a cache_salt input ("private": nobody; "shared": every client)."""
        from snapcompile.artifact.manifest import read_manifest
        from snapcompile.engine.engine import Engine
        self.pb, self.session_sharing = pb_utils, session_sharing
        self.partition_secret = secrets.token_bytes(32)      # this instance's: partitions name no salt
        manifest = read_manifest(artifact)
        if manifest.fingerprint() != fingerprint:
            raise SnapcompileError(f"{artifact} is not the artifact this repository was written for "
                                   "(its manifest's configuration differs); write the repository again")
        self.engine = Engine.from_artifact(artifact, backend=backend, max_slots=slots, threads=threads,
                                           session_cache_bytes=session_cache_bytes, session_keep=session_keep)
        self.engine.backend.make_graphs()            # before Triton marks the model ready
        self.max_prompt_chars = max_prompt_chars(self.engine.tokenizer, self.engine.prompt_limit)
        self.loop = EngineLoop(self.engine, Metrics())
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch_cancellations, name="snapcompile-cancel", daemon=True)
        self.loop.start()
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        self.loop.stop()
        self._watcher.join(5)

    # ------------------------------------------------------------------ requests in
    def submit(self, triton_request) -> None:
        """Hand one Triton request to the engine; a bad one gets an error response at once."""
        sender = triton_request.get_response_sender()
        try:
            request, stream = self._engine_request(triton_request)
        except Exception as err:        # a client's bad input is its error message; a bug is "internal error"
            if isinstance(err, SnapcompileError):
                message = str(err)
            elif isinstance(err, (ValueError, TypeError, OverflowError)):     # float("abc"), int(1e400), ...
                message = f"a request input has a wrong value: {first_line(err)}"
            else:
                log.exception("reading a Triton request failed")
                message = "internal error reading the request"
            sender.send(self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(message)),
                        flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        with self._lock:
            self._pending[request.request_id] = _Pending(triton_request, sender, stream)
        self.loop.submit(request, self._deliver)

    def _engine_request(self, triton_request) -> tuple[Request, bool]:
        text = self._scalar(triton_request, "text_input", None)
        if text is None:
            raise SnapcompileError("text_input is required")
        text = _text(text, "text_input")
        if len(text) > self.max_prompt_chars:          # refused before the tokenizer spends time on it
            raise SnapcompileError(f"text_input has {len(text)} characters: more than this model's context can "
                                   f"hold ({self.max_prompt_chars} at the most)")
        prompt = encode_prompt(self.engine.tokenizer, text)
        try:
            self.engine.check_prompt(prompt)
        except PromptError as err:
            detail = "is empty" if err.reason == "empty" else f"has {err.tokens} tokens"
            raise SnapcompileError(f"text_input {detail}; this model's context allows 1..{err.limit}") from None
        floats = {name: float(self._scalar(triton_request, name, default)) for name, default in FLOAT_INPUTS}
        sampling = SamplingParams(**floats, top_k=max(int(self._scalar(triton_request, "top_k", 0)), 0),
                                  logit_bias=self._logit_bias(triton_request),
                                  seed=_optional_int(self._scalar(triton_request, "seed", None)))
        request = Request(prompt, max_new_tokens=int(self._scalar(triton_request, "max_tokens", DEFAULT_MAX_TOKENS)),
                          stop=self._stops(triton_request), sampling=sampling, request_id=f"triton-{next(_ids)}",
                          ignore_eos=bool(self._scalar(triton_request, "ignore_eos", False)),
                          cache_partition=self._partition(self._scalar(triton_request, "cache_salt", None)))
        return request, bool(self._scalar(triton_request, "stream", False))

    def _logit_bias(self, triton_request) -> tuple[tuple[int, float], ...]:
        """The `logit_bias` input: OpenAI's {"token id": bias} object as JSON text."""
        raw = self._scalar(triton_request, "logit_bias", None)
        if raw is None:
            return ()
        text = _text(raw, "logit_bias")
        if len(text) > MAX_LOGIT_BIAS_CHARS:
            raise SnapcompileError(f"logit_bias has more than {MAX_LOGIT_BIAS_CHARS} characters")
        return logit_bias_pairs(parse_json(text, "logit_bias"))     # ids past the vocabulary: Engine.submit

    def _partition(self, salt) -> str | None:
        """The session-store partition of a request (serve.partitions.cache_partition; Triton has no API key)."""
        return cache_partition(self.partition_secret, None if salt is None else _text(salt, "cache_salt"), False,
                           self.session_sharing)

    def _scalar(self, triton_request, name: str, default):
        tensor = self.pb.get_input_tensor_by_name(triton_request, name)
        if tensor is None:
            return default
        values = tensor.as_numpy().reshape(-1)
        if values.size != 1:
            raise SnapcompileError(f"{name} must hold one value, got {values.size}")
        value = values[0]
        return value.item() if isinstance(value, np.generic) else value

    def _stops(self, triton_request) -> tuple[str, ...]:
        tensor = self.pb.get_input_tensor_by_name(triton_request, "stop")
        if tensor is None:
            return ()
        stops = [_text(s, "stop") for s in tensor.as_numpy().reshape(-1)]
        if len(stops) == 1 and stops[0].startswith("["):       # a JSON list sent as one string
            listed = _json_list(stops[0])
            if listed is not None:
                stops = [str(s) for s in listed]
        return tuple(stops)

    # ------------------------------------------------------------------ responses out
    def _deliver(self, update: Update) -> None:
        """On the engine thread: send what a Triton client should see of this update."""
        request_id = update.event.request_id
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is not None and update.result is not None:
                del self._pending[request_id]
        if pending is None:
            return
        if update.result is not None and update.result.failed:
            self._send_error(pending, update)
            return
        pending.chunks.append(update.event.text)
        final = update.result is not None
        if pending.stream and (update.event.text or final):
            self._send(pending, update.event.text, update, final)
        elif final:
            self._send(pending, "".join(pending.chunks), update, final)

    def _send(self, pending: _Pending, text: str, update: Update, final: bool) -> None:
        pb = self.pb
        result = update.result
        outputs = [pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if final:
            outputs += [pb.Tensor("prompt_tokens", np.array([result.prompt_tokens], dtype=np.int32)),
                        pb.Tensor("completion_tokens", np.array([len(result.output_ids)], dtype=np.int32)),
                        pb.Tensor("finish_reason", np.array([result.outcome.encode()], dtype=np.object_)),
                        pb.Tensor("cached_tokens", np.array([result.cached_tokens], dtype=np.int32))]
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        pending.sender.send(pb.InferenceResponse(output_tensors=outputs), flags=flags)

    def _send_error(self, pending: _Pending, update: Update) -> None:
        if update.result.finish_reason == "abort":        # cancelled: the client is gone, close the stream
            pending.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        message = f"generation failed: {update.result.error or update.result.finish_reason}"
        pending.sender.send(self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(message)),
                            flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _watch_cancellations(self) -> None:
        while not self._stop.wait(CANCEL_POLL_S):
            with self._lock:
                cancelled = [rid for rid, p in self._pending.items() if p.request.is_cancelled()]
            for request_id in cancelled:
                self.loop.abort(request_id)


def _json_list(text: str) -> list | None:
    """`text` parsed as a JSON list, or None when it is not one (a literal stop such as "[END]");
    nesting past the interpreter's recursion limit is an error, not a stop string."""
    try:
        listed = parse_json(text, "stop")
    except JsonTooDeep:
        raise
    except SnapcompileError:
        return None
    return listed if isinstance(listed, list) else None


def _text(value, name: str) -> str:
    """A BYTES tensor element as text: UTF-8, or a one-line error naming the input."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise SnapcompileError(f"{name} is not UTF-8 text") from None
    return check_text(str(value), name)


def _optional_int(value) -> int | None:
    return None if value is None else int(value)
