"""`snapcompile bench-serve`: drive a running OpenAI-compatible server through real HTTP streaming
and report what serving benchmarks report (vLLM's benchmark_serving): request and token
throughput, time to first token, inter-token latency and end-to-end latency at p50/p95/p99.

Each request streams with a fixed output length (`max_tokens`, `ignore_eos`), and the token
counts are the server's own: `/v1/completions` with `stream_options.include_usage` (api "openai",
`snapcompile serve`), or Triton's `/v2/models/MODEL/generate_stream` (api "triton", a repository
from `snapcompile triton-repo`), whose final response carries the counts.

With `turns` > 1 each of the `requests` is a conversation: its client sends `turns` requests one
after another, each the previous prompt, its answer and a new part of `prompt_tokens` tokens (as a
chat client resends its history), and the report adds the TTFT and the tokens the server resumed
from a kept cache (`cached_tokens`) per turn.
"""
from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from snapcompile.errors import SnapcompileError

PERCENTILES = (50, 95, 99)
APIS = ("openai", "triton")


@dataclass(frozen=True)
class ServeBenchConfig:
    url: str                        # the server's base URL, e.g. http://127.0.0.1:8000
    model: str
    requests: int = 32
    concurrency: int = 8
    prompt_tokens: int = 2000
    output_tokens: int = 128
    request_rate: float | None = None   # requests/s (Poisson arrivals); None = all at once
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 3600.0
    api: str = "openai"
    turns: int = 1                  # requests per conversation (each resends the conversation so far)
    follow_up_tokens: tuple[int, int] | None = None   # a later part's tokens, MIN..MAX (None: prompt_tokens)

    def __post_init__(self):
        if self.api not in APIS:
            raise SnapcompileError(f"unknown api {self.api!r}; choose one of {', '.join(APIS)}")
        if self.requests < 1 or self.concurrency < 1:
            raise SnapcompileError("--requests and --concurrency must be >= 1")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise SnapcompileError("--prompt-tokens and --output-tokens must be >= 1")
        if self.request_rate is not None and not self.request_rate > 0:
            raise SnapcompileError("--request-rate must be > 0")
        if not 1 <= self.turns <= 64:
            raise SnapcompileError("--turns must be in 1..64")
        if self.follow_up_tokens is not None and not 1 <= self.follow_up_tokens[0] <= self.follow_up_tokens[1]:
            raise SnapcompileError("--follow-up-tokens must be MIN,MAX with 1 <= MIN <= MAX")

    def part_lengths(self) -> list[int]:
        """Tokens of each conversation's parts, conversation after conversation: the first part
        prompt_tokens, each later one drawn from follow_up_tokens (None: prompt_tokens too)."""
        rng = random.Random(f"follow-ups/{self.seed}")
        return [self.prompt_tokens if turn == 0 or self.follow_up_tokens is None else
                rng.randint(*self.follow_up_tokens) for _ in range(self.requests) for turn in range(self.turns)]


@dataclass
class RequestRecord:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    turn: int = 1
    cached_tokens: int = 0
    text: str = ""


def make_prompts(lengths: list[int], seed: int, tokenizer=None) -> list[str]:
    """One distinct prompt per entry of `lengths`, of that many tokens (exactly, with `tokenizer`;
    about, without: one filler word is about one token)."""
    rng = random.Random(seed)
    words = ("grass", "green", "sky", "blue", "sun", "yellow", "river", "stone", "cloud", "field")
    prompts = []
    for index, tokens in enumerate(lengths):
        text = f"Request {index}, key {rng.randint(10000, 99999)}. " + " ".join(
            rng.choice(words) for _ in range(tokens + 16))
        if tokenizer is not None:
            ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
            text = tokenizer.decode(ids)
        else:
            text = " ".join(text.split()[:tokens])
        prompts.append(text)
    return prompts


def _request(config: ServeBenchConfig, prompt: str, salt: str) -> tuple[str, dict]:
    """(path, body) of one streamed request with a fixed output length, its conversation's cache_salt
    (the server shares kept caches between requests of the same salt only)."""
    if config.api == "triton":
        return (f"/v2/models/{config.model}/generate_stream",
                {"text_input": prompt, "max_tokens": config.output_tokens, "temperature": 0.0, "stream": True,
                 "ignore_eos": True, "cache_salt": salt})
    return "/v1/completions", {"model": config.model, "prompt": prompt, "max_tokens": config.output_tokens,
                               "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                               "ignore_eos": True, "cache_salt": salt}


def _read_chunk(chunk: dict, record: RequestRecord) -> bool:
    """Take the token counts or an error from one streamed chunk; True when it carries new text."""
    if "error" in chunk:
        error = chunk["error"]
        record.error = error.get("message", "error") if isinstance(error, dict) else str(error)
        return False
    usage = chunk.get("usage") or (chunk if "completion_tokens" in chunk else None)
    if usage:
        record.prompt_tokens, record.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens",
                                                                            usage.get("cached_tokens", 0))
    text = chunk.get("text_output") or "".join(choice.get("text") or "" for choice in chunk.get("choices", []))
    record.text += text
    return bool(text)


async def _one(client, config: ServeBenchConfig, prompt: str, turn: int, salt: str) -> RequestRecord:
    record = RequestRecord(turn=turn)
    path, body = _request(config, prompt, salt)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                has_text = _read_chunk(json.loads(line[len("data: "):]), record)
                if record.error:
                    return record
                if has_text:
                    now = time.perf_counter()
                    if record.ttft_s is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
        record.e2e_s = time.perf_counter() - start
        record.ok = record.output_tokens > 0
        if not record.ok:
            record.error = "the stream ended without usage or tokens"
    except Exception as err:  # connection errors, timeouts: a failed request, not a failed benchmark
        record.error = f"{type(err).__name__}: {err}"
    return record


def conversation_parts(prompts: list[str], turns: int) -> list[list[str]]:
    """The prompts as conversations of `turns` parts; a later part starts on a new line."""
    return [[p if k == 0 else "\n" + p for k, p in enumerate(prompts[i:i + turns])]
            for i in range(0, len(prompts), turns)]


async def _conversation(client, config: ServeBenchConfig, parts: list[str], salt: str) -> list[RequestRecord]:
    """One request per part, each the previous prompt, its answer and the part, all with the
    conversation's cache_salt; stops at a failure."""
    records, history = [], ""
    for turn, part in enumerate(parts, 1):
        prompt = history + part
        records.append(await _one(client, config, prompt, turn, salt))
        if not records[-1].ok:
            break
        history = prompt + records[-1].text
    return records


async def _run(config: ServeBenchConfig, prompts: list[str], progress: Callable[[], None]) -> tuple[list, float]:
    import httpx
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    gate = asyncio.Semaphore(config.concurrency)
    rng = np.random.default_rng(config.seed)

    run_id = secrets.token_hex(8)      # a fresh salt per conversation and run: nothing resumes across runs

    async def limited(index: int, parts: list[str], delay: float) -> list[RequestRecord]:
        await asyncio.sleep(delay)
        async with gate:
            records = await _conversation(client, config, parts, f"bench-serve-{run_id}-{index}")
        progress()
        return records
    conversations = conversation_parts(prompts, config.turns)
    delays = np.zeros(len(conversations))
    if config.request_rate:
        delays = np.cumsum(rng.exponential(1.0 / config.request_rate, len(conversations)))
    async with httpx.AsyncClient(base_url=config.url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(config.timeout_s)) as client:
        start = time.perf_counter()
        records = await asyncio.gather(*(limited(i, c, d) for i, (c, d) in enumerate(zip(conversations, delays))))
        return [r for conversation in records for r in conversation], time.perf_counter() - start


def run_serve_bench(config: ServeBenchConfig, prompts: list[str], progress: Callable[[], None] = lambda: None) -> dict:
    """Send `prompts` as `config` says (one request each; with turns > 1, each run of `turns`
    prompts is one conversation's parts); returns the summary, config and errors."""
    records, duration = asyncio.run(_run(config, prompts, progress))
    return summarize(config, records, duration)


def summarize(config: ServeBenchConfig, records: list[RequestRecord], duration_s: float) -> dict:
    done = [r for r in records if r.ok]
    output = sum(r.output_tokens for r in done)
    summary = {"completed": len(done), "failed": len(records) - len(done), "duration_s": duration_s,
               "requests_per_s": len(done) / duration_s, "output_tokens_per_s": output / duration_s,
               "input_tokens_per_s": sum(r.prompt_tokens for r in done) / duration_s,
               "total_output_tokens": output, "total_prompt_tokens": sum(r.prompt_tokens for r in done)}
    for name, values in (("ttft", [r.ttft_s for r in done if r.ttft_s is not None]),
                         ("itl", [gap for r in done for gap in r.itl_s]),
                         ("e2e", [r.e2e_s for r in done if r.e2e_s is not None])):
        summary[f"{name}_ms"] = _stats(values)
    if config.turns > 1:
        summary["per_turn"] = [{"turn": turn, "completed": len(rows),
                                "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in rows])),
                                "cached_tokens_mean": float(np.mean([r.cached_tokens for r in rows])),
                                "ttft_ms": _stats([r.ttft_s for r in rows if r.ttft_s is not None])}
                               for turn in range(1, config.turns + 1)
                               if (rows := [r for r in done if r.turn == turn])]
    errors = sorted({r.error for r in records if r.error})
    return {"config": asdict(config) | {"api_key": None}, "summary": summary, "errors": errors}


def _stats(seconds: list[float]) -> dict:
    if not seconds:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    values = np.asarray(seconds) * 1000
    return {"mean": float(values.mean()), **{f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES}}


def markdown(result: dict) -> str:
    s, c = result["summary"], result["config"]
    rate = "all at once" if c["request_rate"] is None else f"{c['request_rate']:g} req/s"
    turns = c.get("turns", 1)
    sent = (f"{c['requests']} requests" if turns == 1 else
            f"{c['requests']} conversations of {turns} turns ({c['requests'] * turns} requests)")
    lines = [f"{sent}, concurrency {c['concurrency']}, {c['prompt_tokens']} prompt tokens "
             f"{'each' if turns == 1 else 'a first part'}, {c['output_tokens']} output tokens each, arrivals {rate}",
             "",
             "| completed | failed | duration s | requests/s | output tok/s | input tok/s |",
             "|---|---|---|---|---|---|",
             f"| {s['completed']} | {s['failed']} | {s['duration_s']:.1f} | {s['requests_per_s']:.3f} | "
             f"{s['output_tokens_per_s']:.1f} | {s['input_tokens_per_s']:.1f} |", "",
             "| ms | mean | p50 | p95 | p99 |", "|---|---|---|---|---|"]
    for name, label in (("ttft", "time to first token"), ("itl", "inter-token latency"), ("e2e", "end to end")):
        row = s[f"{name}_ms"]
        cells = ["—" if row[k] is None else f"{row[k]:.1f}" for k in ("mean", "p50", "p95", "p99")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if s.get("per_turn"):
        lines += ["", f"Conversations of {c['turns']} turns:", "",
                  "| turn | prompt tokens | resumed tokens | TTFT p50 ms | TTFT p95 ms |", "|---|---|---|---|---|"]
        lines += [f"| {t['turn']} | {t['prompt_tokens_mean']:.0f} | {t['cached_tokens_mean']:.0f} | "
                  f"{t['ttft_ms']['p50']:.1f} | {t['ttft_ms']['p95']:.1f} |" for t in s["per_turn"]]
    if result["errors"]:
        lines += ["", "Errors: " + "; ".join(result["errors"])]
    return "\n".join(lines) + "\n"
