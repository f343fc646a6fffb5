"""`snapcompile serve` and `snapcompile bench-serve`."""
from __future__ import annotations

import ipaddress
import json
import os
import secrets
import sys
from pathlib import Path

import click

from snapcompile.cli.options import FiniteRange, config_default, csv_option, session_cache_option
from snapcompile.runtime import BACKENDS
from snapcompile.serve.bounds import MAX_WAITING, ServerLimits
from snapcompile.serve.partitions import resolve_sharing

LOOPBACK = ("localhost",)
_SHARING_SAID = {"shared": "shared by every client that sends no cache_salt (loopback, no --api-key: one user's "
                           "server)",
                 "private": "kept only for requests with a cache_salt or the API key (the server can be reached "
                            "from other machines, or has an API key)"}


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (another than loopback without --api-key prints a warning).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--slots", type=click.IntRange(min=1), default=None,
              help="Serve at most this many requests at once (default: all of the artifact's static slots).")
@click.option("--max-waiting", type=click.IntRange(min=0), default=MAX_WAITING, show_default=True,
              help="Answer 429 (with Retry-After) once this many requests wait for a slot.")
@click.option("--api-key", envvar="SNAPCOMPILE_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1 routes (or set SNAPCOMPILE_API_KEY).")
@click.option("--served-model-name", "served_model_names", multiple=True,
              help="A model name clients send (repeatable: every one is accepted and listed by /v1/models, the first "
                   "answers requests that name none; default: the folder name).")
@click.option("--allowed-origins", default="", show_default="none",
              help="Browser origins (comma-separated, e.g. http://localhost:3000, or '*') allowed to call the API "
                   "(CORS: preflight OPTIONS answered, Access-Control-Allow-Origin sent). Off by default.")
@click.option("--backend", type=click.Choice(BACKENDS), default="ort", show_default=True,
              help="ort: ONNX Runtime on an artifact folder; trt: TensorRT engines from `snapcompile build`.")
@click.option("--drain-timeout", default=30.0, show_default=True, type=FiniteRange(min=0),
              help="On SIGTERM / Ctrl-C, seconds running requests get to finish (new ones get 503).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="info", show_default=True)
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=config_default(ServerLimits, "max_body_bytes"),
              show_default=True, help="Largest request body (413 beyond), checked before anything is parsed.")
@click.option("--body-timeout", type=FiniteRange(min=0, min_open=True),
              default=config_default(ServerLimits, "body_timeout_s"), show_default=True,
              help="Seconds a client has to send a request body once its head arrived (408 beyond).")
@click.option("--head-timeout", type=FiniteRange(min=0, min_open=True),
              default=config_default(ServerLimits, "head_timeout_s"), show_default=True,
              help="Seconds a connection has to deliver a request head, from opening or from its last response "
                   "(slow clients are closed).")
@click.option("--keep-alive", type=FiniteRange(min=0, min_open=True),
              default=config_default(ServerLimits, "keep_alive_s"), show_default=True,
              help="Seconds an idle kept-alive connection stays open.")
@click.option("--max-connections", type=click.IntRange(min=1), default=config_default(ServerLimits, "max_connections"),
              show_default=True, help="Open connections served at once (503 beyond).")
@click.option("--max-connections-per-client", type=click.IntRange(min=0),
              default=config_default(ServerLimits, "max_connections_per_client"), show_default=True,
              help="Open connections from one client address; a connection past them is closed at once "
                   "(0: no bound). Behind a proxy every client has the proxy's address.")
@click.option("--forwarded-allow-ips", default="", show_default="none",
              help="Proxies (addresses or networks, comma-separated, or '*') whose X-Forwarded-For header names "
                   "the client the per-client bounds count. From any other connection, loopback included, the "
                   "header is ignored.")
@click.option("--max-requests-per-client", type=click.IntRange(min=0),
              default=config_default(ServerLimits, "max_requests_per_client"), show_default=True,
              help="Requests in flight (running or waiting) from one client address, each prompt of a "
                   "/v1/completions list counted; 429 beyond (0: no bound).")
@click.option("--send-timeout", type=FiniteRange(min=0, min_open=True),
              default=config_default(ServerLimits, "send_timeout_s"), show_default=True,
              help="Seconds a response may wait for a client that stopped reading it; then the connection "
                   "is dropped and its request aborted.")
@click.option("--render-timeout", type=FiniteRange(min=0, min_open=True),
              default=config_default(ServerLimits, "render_timeout_s"), show_default=True,
              help="Seconds the artifact's chat template and tokenizer may take for one request, the wait for "
                   "a tokenizer worker included (400 beyond; a worker past it is killed and replaced).")
@click.option("--tokenizer-workers", type=click.IntRange(min=1),
              default=config_default(ServerLimits, "tokenizer_workers"), show_default=True,
              help="Worker processes rendering chat templates, and as many tokenizing plain prompts (each holds "
                   "its own tokenizer: ~120 MB for SmolLM2's, ~330 MB for Gemma 3's 262144 tokens; each bounded "
                   "to 2 GiB beyond its tokenizer).")
@click.option("--max-prompts-per-request", type=click.IntRange(min=1),
              default=config_default(ServerLimits, "max_prompts"), show_default=True,
              help="Prompts one /v1/completions request may carry (a list of prompts; 400 beyond). Each is "
                   "an engine request of its own, answered as one choice.")
@click.option("--prefill-tokens-per-step", type=click.IntRange(min=1), default=None,
              help="Prompt tokens prefilled between two decode steps, in whole chunks (default: one chunk). "
                   "Fewer bound the inter-token latency of running requests; more shorten the time to a new "
                   "request's first token. A smaller --chunk at convert time makes the step finer.")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A Jinja chat template file used instead of the artifact's (as transformers renders it: "
                   "messages, tools, add_generation_prompt, the special tokens; at most 1 MiB). Rendered in the "
                   "tokenizer workers within --render-timeout, as the artifact's own.")
@click.option("--reasoning-parser", type=click.Choice(["deepseek_r1", "qwen3"]), default=None,
              help="Give a reasoning model's thinking (<think>...</think>) as the chat message's reasoning_content "
                   "apart from its content, as vLLM's parsers of these names do (default: none, all is content).")
@session_cache_option(sharing=True, auto=True)
def serve(artifact, host, port, slots, max_waiting, api_key, served_model_names, allowed_origins, backend,
          drain_timeout, log_level,
          max_body_bytes, body_timeout, head_timeout, keep_alive, max_connections, max_connections_per_client,
          forwarded_allow_ips, max_requests_per_client, send_timeout, render_timeout, tokenizer_workers,
          max_prompts_per_request, prefill_tokens_per_step, chat_template, reasoning_parser,
          session_cache_bytes, session_keep, session_sharing):
    """Serve ARTIFACT over an OpenAI-compatible HTTP API.

    POST /v1/chat/completions and /v1/completions (streamed or not), GET /v1/models, /health
    (200 once the graphs are loaded, 503 before and while draining) and /metrics (Prometheus).
    Requests join and leave the continuous batch at any step; a client that disconnects frees
    its slot. SIGTERM or Ctrl-C drains: new requests get 503, running ones finish (up to
    --drain-timeout), then the server exits 0; a second signal stops at once.
    """
    if not _needs_torch(Path(artifact), backend):
        _without_torch()
    from snapcompile.artifact.files import check_files
    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.serve.app import ServerSettings
    from snapcompile.serve.server import serve as run_server
    manifest = read_manifest(artifact)                 # bad artifacts fail here, before the port opens
    check_files(artifact, manifest, checksums=False)
    if chat_template is not None:
        from snapcompile.prompts import read_chat_template
        read_chat_template(chat_template)              # a bad file fails here, before the port opens
    if api_key is not None and not api_key.strip():
        raise click.BadParameter("the API key is empty", param_hint="--api-key")
    if api_key is not None and not all("!" <= char <= "~" for char in api_key):
        raise click.BadParameter("the API key must be printable ASCII without spaces (a client sends it in an HTTP "
                                 "header, stripped: any other key could never match)", param_hint="--api-key")
    if api_key is None and not _loopback(host):
        click.echo(f"warning: serving on {host} without --api-key: anyone who reaches this address can use it",
                   err=True)
    limits = ServerLimits(max_body_bytes=max_body_bytes, body_timeout_s=body_timeout, head_timeout_s=head_timeout,
                          keep_alive_s=keep_alive, max_connections=max_connections,
                          max_connections_per_client=max_connections_per_client,
                          max_requests_per_client=max_requests_per_client, send_timeout_s=send_timeout,
                          render_timeout_s=render_timeout, tokenizer_workers=tokenizer_workers,
                          max_prompts=max_prompts_per_request,
                          forwarded_allow_ips=_proxies(forwarded_allow_ips))
    names = [name.strip() for name in served_model_names if name.strip()] or [Path(artifact).resolve().name]
    sharing = resolve_sharing(session_sharing, _loopback(host), api_key is not None)
    if session_sharing == "auto":
        click.echo(f"kept caches: {_SHARING_SAID[sharing]} (--session-sharing auto; private or shared to choose)",
                   err=True)
    settings = ServerSettings(Path(artifact), names[0], api_key,
                              max_waiting, slots, backend, limits, prefill_tokens_per_step, session_cache_bytes,
                              session_keep, sharing, aliases=tuple(names[1:]),
                              allowed_origins=_origins(allowed_origins), chat_template=chat_template,
                              reasoning_parser=reasoning_parser)
    run_server(settings, host, port, drain_timeout, log_level)


def _origins(value: str) -> tuple[str, ...]:
    """--allowed-origins checked: '*' or scheme://host[:port] origins, comma-separated."""
    from urllib.parse import urlsplit
    origins = tuple(entry.strip().rstrip("/") for entry in value.split(",") if entry.strip())
    for origin in origins:
        parts = urlsplit(origin)
        if origin != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path):
            raise click.BadParameter(f"{origin!r} is not an origin (scheme://host[:port]) or '*'",
                                     param_hint="--allowed-origins")
    return origins


def _proxies(value: str) -> str:
    """--forwarded-allow-ips checked: '*' or addresses / networks, comma-separated (uvicorn's form)."""
    entries = [entry.strip() for entry in value.split(",") if entry.strip()]
    for entry in entries:
        if entry != "*":
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise click.BadParameter(f"{entry!r} is not an IP address or network",
                                         param_hint="--forwarded-allow-ips") from None
    return ",".join(entries)


def _needs_torch(artifact: Path, backend: str) -> bool:
    """Whether serving `artifact` may need torch: TensorRT (its plugins' kernels), or custom op
    nodes run by ONNX Runtime (a plugin lowering, served by torch implementations). Read from the
    manifest's JSON alone, before anything imports transformers; anything unreadable says yes
    (read_manifest reports it a moment later)."""
    if backend != "ort":
        return True
    try:
        return json.loads((artifact / "manifest.json").read_bytes()[:2**24]).get("lowering", "standard") != "standard"
    except (OSError, ValueError, AttributeError):
        return True


def _without_torch() -> None:
    """Keep torch out of the serving process (~185 MB less RSS at SmolLM2's shape): nothing on the
    serving path needs it, and transformers, imported for the tokenizer, imports it whenever it is
    installed unless it is marked absent before transformers is first imported. A process that
    already holds either (a test runner) is left as it is."""
    if "torch" not in sys.modules and "transformers" not in sys.modules:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")    # no "PyTorch was not found" line
        sys.modules["torch"] = None


def _loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.command(name="bench-serve")
@click.argument("url")
@click.option("--model", required=True, help="The served model name.")
@click.option("--requests", "num_requests", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--concurrency", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-tokens", default=2000, show_default=True, type=click.IntRange(min=1))
@click.option("--output-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--request-rate", type=FiniteRange(min=0, min_open=True), default=None,
              help="Requests per second (Poisson arrivals); default: all at once, --concurrency at a time.")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(path_type=Path), default=None,
              help="An artifact (or model folder) whose tokenizer makes prompts of exactly --prompt-tokens.")
@click.option("--api-key", envvar="SNAPCOMPILE_API_KEY", default=None)
@click.option("--api", type=click.Choice(["openai", "triton"]), default="openai", show_default=True,
              help="openai: /v1/completions of `snapcompile serve`; triton: the generate_stream endpoint of a "
                   "Triton repository from `snapcompile triton-repo` (--model is the Triton model name).")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Seed of the prompts and arrivals (default: a fresh random one per run, recorded in the results: "
                   "a fixed default would let a server with a prompt cache report false TTFTs).")
@click.option("--turns", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Each of --requests is a conversation of this many requests, one after another: each the "
                   "previous prompt, its answer and a new part of --prompt-tokens (reports TTFT and resumed "
                   "tokens per turn).")
@click.option("--follow-up-tokens", callback=csv_option(int), default=None,
              help="MIN,MAX: with --turns, each later part's tokens drawn between them (eval-turns' follow-ups "
                   "run 5,200); default: --prompt-tokens, as the first part.")
@click.option("--save-prompts", type=click.Path(path_type=Path), default=None,
              help="Also write the prompts as a JSONL prompts file (for `snapcompile run --prompts` on the same; "
                   'with --turns, one {"turns": [...]} line per conversation).')
@click.option("-o", "--output", type=click.Path(path_type=Path), default=Path("bench-serve.json"), show_default=True,
              help="Results JSON; the Markdown table is written beside it.")
@click.option("--force", is_flag=True, help="Replace the --output file if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON object.")
def bench_serve(url, model, num_requests, concurrency, prompt_tokens, output_tokens, request_rate, tokenizer_dir,
                api_key, api, seed, turns, follow_up_tokens, save_prompts, output, force, as_json):
    """Benchmark a running server at URL through real HTTP streaming.

    Sends --requests completions of --prompt-tokens prompt tokens and exactly --output-tokens
    generated tokens each, --concurrency at a time, and reports requests/s, output tokens/s,
    TTFT, inter-token and end-to-end latency (mean, p50, p95, p99) and failures.
    """
    from snapcompile.atomic import check_output_file, write_json_atomic, write_text_atomic
    from snapcompile.cli import progress_bar
    from snapcompile.serve.load_client import (
        ServeBenchConfig,
        conversation_parts,
        make_prompts,
        markdown,
        run_serve_bench,
    )
    if follow_up_tokens is not None and len(follow_up_tokens) != 2:
        raise click.BadParameter("expected MIN,MAX", param_hint="--follow-up-tokens")
    if seed is None:
        seed = secrets.randbelow(2**31)
    config = ServeBenchConfig(url.rstrip("/"), model, num_requests, concurrency, prompt_tokens, output_tokens,
                              request_rate, seed, api_key, api=api, turns=turns,
                              follow_up_tokens=follow_up_tokens and tuple(follow_up_tokens))
    output = check_output_file(output, force, read_folders=(tokenizer_dir,))
    tokenizer = None
    if tokenizer_dir is not None:
        from snapcompile.models.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(tokenizer_dir)
    prompts = make_prompts(config.part_lengths(), seed, tokenizer)
    if save_prompts is not None:
        lines = ([{"prompt": p} for p in prompts] if turns == 1 else
                 [{"turns": parts} for parts in conversation_parts(prompts, turns)])
        write_text_atomic(check_output_file(save_prompts, force), "".join(json.dumps(x) + "\n" for x in lines))
    unit = "conversation" if turns > 1 else "request"
    with progress_bar(total=num_requests, desc=unit + "s", unit=unit[:4], disable=as_json) as bar:
        result = run_serve_bench(config, prompts, progress=lambda: bar.update(1))
    table = markdown(result)
    write_json_atomic(output, result)
    write_text_atomic(output.with_suffix(".md"), table)
    click.echo(json.dumps(result) if as_json else table + f"wrote {output}, {output.with_suffix('.md')}")
    if result["summary"]["failed"]:
        sys.exit(1)
