"""`snapcompile serve`: a real server process on a free local port, driven by the official openai client."""
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner

from snapcompile.cli import main
from snapcompile.config import ExportConfig
from tests.conftest import FAULT_SEED, TINY_SNAPSTREAM, build_artifact, run_results
from tests.server_process import ServerProcess

PROMPTS = ["The quick brown fox", "jumps over", "the lazy dog " * 20, "a", "hello world " * 8, "x y z"]


@pytest.fixture(scope="module")
def artifact(tiny_llama, tmp_path_factory):
    return build_artifact(tiny_llama, tmp_path_factory.mktemp("serve") / "tiny4",
                          ExportConfig(slots=4, max_context=512, chunk=64), TINY_SNAPSTREAM)


@pytest.fixture(scope="module")
def server(artifact, tmp_path_factory):
    process = ServerProcess(artifact, log=tmp_path_factory.mktemp("log") / "server.log").wait_ready()
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def run_rows(artifact):
    """`snapcompile run` on PROMPTS (raw prompts, greedy, 12 new tokens): the reference results."""
    return run_results(artifact, PROMPTS, 12)


def test_completions_equal_run_streamed_or_not(client, run_rows):
    for prompt, expected in zip(PROMPTS, run_rows):
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert whole.choices[0].text == expected["text"]
        assert whole.usage.prompt_tokens == expected["prompt_tokens"]
        assert whole.usage.completion_tokens == expected["output_tokens"]
        assert whole.choices[0].finish_reason == {"eos": "stop", "length": "length"}[expected["finish_reason"]]
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["text"]
        assert chunks[-1].usage.completion_tokens == expected["output_tokens"] and chunks[-1].choices == []


def test_completions_take_prompt_lists_and_token_ids_as_openai_defines_them(client, run_rows, artifact):
    """A list of prompts (text or token ids) is one choice each, in order, each equal to the prompt
    alone; usage is the sum; echo puts the prompt's text before each choice's."""
    from snapcompile import Engine
    encode = Engine.from_artifact(artifact, session_cache_bytes=0).encode
    ids = [encode(prompt) for prompt in PROMPTS[:3]]
    for prompt in (PROMPTS[:3], ids, ids[0]):
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        expected = run_rows[:len(reply.choices)]
        assert [c.index for c in reply.choices] == list(range(len(expected)))
        assert [c.text for c in reply.choices] == [row["text"] for row in expected]
        assert reply.usage.prompt_tokens == sum(row["prompt_tokens"] for row in expected)
        assert reply.usage.completion_tokens == sum(row["output_tokens"] for row in expected)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    for index, row in enumerate(run_rows[:3]):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index) == row["text"]
    assert chunks[-1].usage.completion_tokens == sum(row["output_tokens"] for row in run_rows[:3])
    echoed = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=12, temperature=0, echo=True)
    assert [c.text for c in echoed.choices] == [p + row["text"] for p, row in zip(PROMPTS[:2], run_rows)]


def test_chat_equals_the_engine_with_the_chat_template(client, artifact):
    from snapcompile import Engine, Request
    engine = Engine.from_artifact(artifact, session_cache_bytes=0)
    for text in PROMPTS[:3]:
        expected = engine.generate([Request(engine.encode(text, chat=True), max_new_tokens=10)])[0]
        messages = [{"role": "user", "content": text}]
        whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
        assert whole.choices[0].message.content == expected.text and whole.choices[0].message.role == "assistant"
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (expected.prompt_tokens,
                                                                               len(expected.output_ids))
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                stream=True)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_logprobs_and_stop_strings(client, run_rows):
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    text = run_rows[2]["text"]
    stop = text[3:5]
    if len(stop) == 2:                           # a stop string from the middle of the greedy text
        cut = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0, stop=[stop])
        assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
        streamed = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                             stop=stop, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == text[:text.find(stop)]


def test_32_requests_from_16_clients_on_4_slots(client, artifact, server):
    from snapcompile import Engine, Request
    prompts = [f"request {i} " * (1 + i % 7) for i in range(32)]
    lengths = [4 + i % 9 for i in range(32)]
    engine = Engine.from_artifact(artifact, session_cache_bytes=0)
    alone = [engine.generate([Request(engine.encode(p, chat=False), max_new_tokens=n)])[0].text
             for p, n in zip(prompts, lengths)]

    def ask(index):
        reply = client.completions.create(model="tiny", prompt=prompts[index], max_tokens=lengths[index],
                                          temperature=0)
        return reply.choices[0].text
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(ask, range(32)))
    assert texts == alone
    assert server.metric("snapcompile_slots_in_use") == 0


@pytest.mark.parametrize("kwargs, status, fragment", [
    ({"model": "nope"}, 404, "does not exist"),
    ({"n": 5}, 400, "n=5: the samples of a prompt share its prefill"),
    ({"n": 17}, 400, "n"),
    ({"temperature": 5}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, 400, "name"),
    ({"messages": [{"role": "user", "content": ""}]}, 200, ""),           # the template makes it non-empty
    ({"messages": [{"role": "user", "content": "x" * 600}]}, 400, "tokens; this model's context allows at most 512"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "only text content parts"),
    ({"top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
    ({"stop": [""]}, 400, "stop strings must not be empty"),
])
def test_chat_errors_have_openai_shape(server, kwargs, status, fragment):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kwargs}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    if status != 200:
        error = response.json()["error"]
        assert fragment in error["message"] and set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps({"model": "tiny", "prompt": ""}).encode(), "the prompt is empty"),
    (json.dumps({"model": "tiny", "prompt": "x" * 513}).encode(), "513 tokens; this model's context allows"),
    (json.dumps({"model": "tiny"}).encode(), "prompt: Field required"),
    (json.dumps({"model": "tiny", "prompt": []}).encode(), "the prompt list is empty"),
    (json.dumps({"model": "tiny", "prompt": ["a"] * 33}).encode(), "33 prompts in one request; this server"),
    (json.dumps({"model": "tiny", "prompt": [5, 320]}).encode(), "prompt token ids must lie in [0, 320)"),
    (json.dumps({"model": "tiny", "prompt": [[5], [-1]]}).encode(), "prompt token ids must lie in [0, 320)"),
    (json.dumps({"model": "tiny", "prompt": [[]]}).encode(), "the prompt is empty"),
    (json.dumps({"model": "tiny", "prompt": [True]}).encode(), "prompt"),
    (json.dumps({"model": "tiny", "prompt": ["a", [5]]}).encode(), "prompt"),
    (json.dumps({"model": "tiny", "prompt": [5] * 513}).encode(), "513 tokens; this model's context allows"),
    (json.dumps({"model": "tiny", "prompt": "x", "prompt_logprobs": 21}).encode(), "prompt_logprobs: Input should"),
    (b"[" * 1000 + b"]" * 1000, "nests deeper than 64 levels"),
    (b"[" * 100 + b"]" * 100, "nests deeper than 64 levels"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"model": "tiny", "prompt": "a\\ud800b"}', "lone UTF-16 surrogate"),
    (json.dumps({"model": "tiny", "prompt": "x", "stop": ["q" * 2_000_000]}).encode(), "at most 256 characters"),
    (json.dumps({"model": "tiny", "prompt": "x" * 1_000_000}).encode(), "more than this model's context can hold"),
    (json.dumps({"model": "tiny", "prompt": "x", "stream": "yes"}).encode(), "stream: Input should be a valid boolean"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": True}).encode(), "max_tokens: Input should be a valid"),
])
def test_completion_errors(server, body, fragment):
    response = httpx.post(server.url + "/v1/completions", content=body, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and fragment in response.json()["error"]["message"], response.text


@pytest.mark.parametrize("method, path, headers, body, status, fragment", [
    ("POST", "/v1/completions", {"Content-Type": "text/plain"}, b'{"model": "tiny", "prompt": "x"}', 415,
     "Content-Type: application/json"),
    ("POST", "/v1/completions", {}, b'{"model": "tiny", "prompt": "x"}', 415, "Content-Type: application/json"),
    ("POST", "/v1/completions", {"Content-Type": "application/json"}, b" " * (4 * 2**20 + 1), 413, "at most"),
    ("GET", "/v1/nothing", {}, b"", 404, "no such route"),
    ("POST", "/v1/completions/", {"Content-Type": "application/json"}, b'{"model": "tiny", "prompt": "x"}', 404,
     "no such route"),                                  # no slash redirect (a 307 that clients may not follow)
    ("GET", "/v1/completions", {}, b"", 405, "Method Not Allowed"),
])
def test_bad_requests_are_refused_in_openai_shape(server, method, path, headers, body, status, fragment):
    response = httpx.request(method, server.url + path, headers=headers, content=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == status and fragment in error["message"], response.text
    assert set(error) == {"message", "type", "param", "code"}


def test_unknown_fields_are_ignored(server):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "user": "me", "metadata": {"a": 1}, "store": False}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200


LONG = 4000     # tokens: near the tiny model's 4096 positions, ~1.8 s of generation (2 cores)


def test_a_disconnect_frees_the_slot(server):
    aborted = server.metric("snapcompile_requests_total", 'outcome="abort"')
    body = {"model": "tiny", "prompt": "go", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert server.metric("snapcompile_slots_in_use") == 1
    deadline = time.monotonic() + 30
    while server.metric("snapcompile_slots_in_use") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("snapcompile_slots_in_use") == 0
    assert server.metric("snapcompile_requests_total", 'outcome="abort"') == aborted + 1


def test_a_disconnect_during_a_non_streamed_request_frees_the_slot(server):
    aborted = server.metric("snapcompile_requests_total", 'outcome="abort"')
    body = {"model": "tiny", "prompt": "go", "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):            # the client gives up and closes the connection
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.2))
    deadline = time.monotonic() + 30
    while server.metric("snapcompile_requests_total", 'outcome="abort"') == aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("snapcompile_requests_total", 'outcome="abort"') == aborted + 1
    assert server.metric("snapcompile_slots_in_use") == 0


def test_models_health_and_metrics(server, client):
    client.completions.create(model="tiny", prompt="x", max_tokens=2)        # something to count
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert server.metric("snapcompile_slots") == 4
    assert server.metric("snapcompile_generation_tokens_total") > 0
    assert server.metric("snapcompile_time_to_first_token_seconds_count") > 0
    assert server.metric("snapcompile_kv_cache_bytes") == 4 * 64 * 512


def test_api_key_and_queue_limit(artifact, tmp_path):
    process = ServerProcess(artifact, "--api-key", "secret", "--max-waiting", "0",
                            log=tmp_path / "server.log").wait_ready()
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
            response = httpx.post(process.url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        assert httpx.get(process.url + "/v1/models", timeout=30).status_code == 401
        assert httpx.get(process.url + "/health", timeout=30).status_code == 200
        response = httpx.post(process.url + "/v1/completions", json=body,
                              headers={"Authorization": "Bearer secret"}, timeout=30)
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
    finally:
        assert process.stop() == 0


def test_sigterm_drains_running_requests_and_exits_0(artifact, tmp_path):
    process = ServerProcess(artifact, "--drain-timeout", "60", log=tmp_path / "server.log").wait_ready()
    # long enough (positions up to 4096 on this snapstream artifact) to outlast the checks below: with 300
    # tokens an unloaded machine finished the stream, drained and exited before /health was asked
    body = {"model": "tiny", "prompt": "go", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    texts, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", process.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                started.set()
                texts.append(line)
    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    process.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(process.url + "/health", timeout=5).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.02)
    health = httpx.get(process.url + "/health", timeout=5)
    refused = httpx.post(process.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=5)
    reader.join(120)
    assert process.process.wait(60) == 0
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    finals = [json.loads(t[6:]) for t in texts if t.startswith("data: {")]
    assert finals[-1]["choices"][0]["finish_reason"] == "length" and [t for t in texts if t][-1] == "data: [DONE]"


def test_bench_serve_reports_a_run(server, artifact, tmp_path):
    out, prompts = tmp_path / "bs.json", tmp_path / "prompts.jsonl"
    result = CliRunner().invoke(main, ["bench-serve", server.url, "--model", "tiny", "--requests", "8",
                                       "--concurrency", "4", "--prompt-tokens", "40", "--output-tokens", "6",
                                       "--tokenizer", str(artifact), "--save-prompts", str(prompts),
                                       "-o", str(out), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    same = CliRunner().invoke(main, ["run", str(artifact), "--prompts", str(prompts), "--max-new-tokens", "6",
                                     "--ignore-eos", "--json"], catch_exceptions=False)
    rows = json.loads(same.output.strip().splitlines()[-1])["results"]
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in rows] == [(40, 6)] * 8, "the same prompts, run alone"
    summary = json.loads(out.read_text())["summary"]
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (8, 0, 48)
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"] and summary["itl_ms"]["p99"] is not None
    assert "| time to first token |" in out.with_suffix(".md").read_text()
    bad = CliRunner().invoke(main, ["bench-serve", server.url, "--model", "nope", "--requests", "2",
                                    "-o", str(tmp_path / "b2.json")])
    assert bad.exit_code == 1 and json.loads((tmp_path / "b2.json").read_text())["summary"]["failed"] == 2


def test_an_engine_fault_fails_one_request_and_the_server_goes_on(artifact, faulty_sampling):
    """In-process (the fault is injected into this process's engine), still over real HTTP."""
    import uvicorn

    from snapcompile.serve.app import ServerSettings, ServerState, create_app, load_engine
    from tests.server_process import free_port
    state = ServerState(ServerSettings(artifact, "tiny"))
    load_engine(state)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0}
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda seed: httpx.post(url + "/v1/completions", json={**body, "seed": seed},
                                                            timeout=60), [1, FAULT_SEED, 2]))
        assert [r.status_code for r in replies] == [200, 500, 200]
        assert "injected fault" in replies[1].json()["error"]["message"]
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(30)
        state.close()


@pytest.mark.slow
def test_smollm2_answers_20_prompts_under_a_json_schema(smol_snap, tmp_path):
    """The real model through the openai SDK's `parse` with a pydantic model: every one of 20 answers
    parses and validates (a 135M model may answer badly, never invalidly); and through pydantic-ai
    (its tool-call output mode)."""
    import pydantic

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=40)
        age: int = pydantic.Field(ge=0, le=120)
        city: str = pydantic.Field(max_length=40)

    people = ["Marie Curie", "Albert Einstein", "Ada Lovelace", "Alan Turing", "Isaac Newton", "Nikola Tesla",
              "Rosalind Franklin", "Charles Darwin", "Grace Hopper", "Galileo Galilei"]
    prompts = ([f"Describe {p} as JSON with name, age and city." for p in people]
               + [f"Invent person number {i}: their name, age and city as JSON." for i in range(10)])
    process = ServerProcess(smol_snap, model="smollm2", log=tmp_path / "server.log").wait_ready(300)
    try:
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=600)

        def ask(prompt):
            return client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                                 response_format=Person, max_tokens=96, temperature=0)
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(ask, prompts))
        assert all(r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Person)
                   for r in replies)
        from pydantic_ai import Agent
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider
        model = OpenAIChatModel("smollm2", provider=OpenAIProvider(base_url=process.url + "/v1", api_key="unused"))
        answer = Agent(model, output_type=Person).run_sync("Describe Marie Curie: name, age, city.",
                                                           model_settings={"temperature": 0, "max_tokens": 160})
        assert isinstance(answer.output, Person)
    finally:
        assert process.stop() == 0


@pytest.mark.slow
def test_smollm2_through_the_server(smol_snap, tmp_path):
    from snapcompile.passkeys import passkey_prompt
    process = ServerProcess(smol_snap, model="smollm2", log=tmp_path / "server.log").wait_ready(300)
    try:
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        question = passkey_prompt(48213, 1200, depth=0.3)
        reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                               max_tokens=12, temperature=0)
        assert "48213" in reply.choices[0].message.content
        chunks = list(client.chat.completions.create(model="smollm2", max_tokens=12, temperature=0, stream=True,
                                                     messages=[{"role": "user", "content": question}]))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    finally:
        assert process.stop() == 0


def test_an_engine_thread_that_dies_fails_its_requests_turns_health_503_and_exits_1(artifact, tmp_path):
    """A real `serve` process whose engine thread raises outside Engine.step (tests/fault_server.py)."""
    server = ServerProcess(artifact, launcher=("-m", "tests.fault_server"), log=tmp_path / "log").wait_ready()
    try:
        reply = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 500 and "the engine stopped" in reply.json()["error"]["message"]
        try:
            health = httpx.get(server.url + "/health", timeout=5).status_code
        except httpx.HTTPError:          # it may already have stopped
            health = None
        assert health in (503, None)
        assert server.process.wait(30) == 1
    finally:
        server.stop()
    assert "planted bug in the engine loop" in (tmp_path / "log").read_text()


def test_slow_clients_are_closed_and_real_clients_are_served(artifact, tmp_path):
    """20 connections that send their request head a byte at a time are closed after --head-timeout,
    while a real client gets its answer; bounded in count and time, loopback only."""
    server = ServerProcess(artifact, "--head-timeout", "1", "--keep-alive", "1",
                           log=tmp_path / "log").wait_ready()
    slow = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(20)]
    try:
        started, closed_after = time.monotonic(), {}
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        for step in range(40):                      # at most ~8 s of dripping
            for index, sock in enumerate(slow):
                if index in closed_after:
                    continue
                try:
                    sock.sendall(head[step % len(head):step % len(head) + 1])
                except OSError:
                    closed_after[index] = time.monotonic() - started
            reply = httpx.post(server.url + "/v1/completions", timeout=30,
                               json={"model": "tiny", "prompt": "hi", "max_tokens": 2}) if step == 2 else None
            if reply is not None:
                assert reply.status_code == 200
            if len(closed_after) == len(slow):
                break
            time.sleep(0.2)
        assert len(closed_after) == len(slow), f"{len(slow) - len(closed_after)} slow clients still open"
        assert max(closed_after.values()) < 5
    finally:
        for sock in slow:
            sock.close()
        server.stop()


def test_hostile_templates_and_tokenizers_are_bounded_and_hold_only_their_lane(artifact, tmp_path):
    """A crafted artifact (tests.cli_helpers.hostile_copy): a looping template is refused after
    --render-timeout while /health and plain completions answer at once; a template allocating 3 GB
    and one rendering 30 million characters are refused; a prompt the quadratic tokenizer would
    take ~30 s on is refused after the timeout; the server answers normally after all of it, and
    SIGTERM still drains and exits 0."""
    from tests.cli_helpers import hostile_copy
    crafted = hostile_copy(artifact, tmp_path / "crafted")   # a copy: the module's artifact serves the other tests
    server = ServerProcess(crafted, "--render-timeout", "2", log=tmp_path / "log").wait_ready()

    def chat(content):
        return httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2})

    def complete(prompt):
        return httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
    try:
        with ThreadPoolExecutor(2) as pool:
            started = time.monotonic()
            looping = [pool.submit(chat, "loop") for _ in range(2)]
            times = []
            while not all(reply.done() for reply in looping) and time.monotonic() - started < 30:
                begin = time.monotonic()
                assert httpx.get(server.url + "/health", timeout=5).status_code == 200
                assert complete("hi").status_code == 200
                times.append(time.monotonic() - begin)
                time.sleep(0.1)
            for reply in looping:
                reply = reply.result(timeout=30)
                assert reply.status_code == 400 and "did not render within 2 s" in reply.json()["error"]["message"]
        assert times and max(times) < 1.5, times
        for content, fragment in (("huge", "out of memory"), ("long", "rendered 30000000 characters")):
            reply = chat(content)
            assert reply.status_code == 400 and fragment in reply.json()["error"]["message"], reply.text
        reply = complete("a" * 100_000)
        assert reply.status_code == 400 and "did not finish within 2 s" in reply.json()["error"]["message"]
        assert chat("hi").status_code == 200 and complete("hi").status_code == 200
    finally:
        assert server.stop() == 0


def test_the_accept_failure_log_line_is_rate_limited():
    import logging

    from snapcompile.serve.limits import RateLimitedLog
    clock = iter([0.0, 1.0, 2.0, 11.0, 11.5])
    log_filter = RateLimitedLog("out of system resource", interval_s=10.0, clock=lambda: next(clock))
    records = [logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource",
                                 (), None) for _ in range(5)]
    passed = [log_filter.filter(r) for r in records]
    assert passed == [True, False, False, True, False]
    assert "(and 2 more in the last 10 s)" in records[3].getMessage()
    assert log_filter.filter(logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "other", (), None))


def test_bench_serve_draws_a_fresh_seed_per_run_unless_given(server, tmp_path):
    """A fixed default seed would resend the same prompts, and a server with a prompt cache would
    report false TTFTs."""
    def run(name, *seed):
        out = tmp_path / f"{name}.json"
        result = CliRunner().invoke(main, ["bench-serve", server.url, "--model", "tiny", "--requests", "2",
                                           "--prompt-tokens", "16", "--output-tokens", "2", *seed,
                                           "--save-prompts", str(tmp_path / f"{name}.jsonl"), "-o", str(out)],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(out.read_text())["config"]["seed"], (tmp_path / f"{name}.jsonl").read_text()
    (seed_a, prompts_a), (seed_b, prompts_b) = run("a"), run("b")
    assert seed_a != seed_b and prompts_a != prompts_b
    assert run("c", "--seed", str(seed_a)) == (seed_a, prompts_a)


def test_prefill_tokens_per_step_reaches_the_engine(artifact):
    from snapcompile.serve.app import ServerSettings, ServerState, load_engine
    state = ServerState(ServerSettings(artifact, "tiny", prefill_tokens_per_step=128))
    load_engine(state)
    try:
        assert state.engine_loop.engine.scheduler.prefill_tokens_per_step == 128
    finally:
        state.engine_loop.stop()


def test_a_chat_that_resends_its_history_resumes_its_cache(server, client, artifact):
    """Each turn sends the whole conversation with the conversation's cache_salt; the server resumes
    the kept cache of the turn before (usage.prompt_tokens_details.cached_tokens, /metrics) and
    answers as an engine with the same store does."""
    salt = {"cache_salt": "lighthouse-conversation"}
    from snapcompile import Engine, Request
    from snapcompile.prompts import encode_messages
    engine = Engine.from_artifact(artifact, session_cache_bytes=2**26)
    hits, reused = (server.metric(f"snapcompile_session_cache_{n}_total") for n in ("hits", "reused_tokens"))
    messages = [{"role": "user", "content": "Tell me a story about a lighthouse keeper " * 4}]
    cached = []
    for question in ("And then what happened to him?", "Why did the ships stop coming " * 3):
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                               extra_body=salt)
        expected, = engine.generate([Request(encode_messages(engine.tokenizer, messages), max_new_tokens=12)])
        assert reply.choices[0].message.content == expected.text
        assert reply.usage.prompt_tokens_details.cached_tokens == expected.cached_tokens
        cached.append(expected.cached_tokens)
        messages += [{"role": "assistant", "content": expected.text}, {"role": "user", "content": question}]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=salt)
    chunks = list(stream)
    expected, = engine.generate([Request(encode_messages(engine.tokenizer, messages), max_new_tokens=12)])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == expected.cached_tokens
    cached.append(expected.cached_tokens)
    assert cached[0] == 0 and 64 <= cached[1] < cached[2], cached
    assert server.metric("snapcompile_session_cache_hits_total") == hits + 2
    assert server.metric("snapcompile_session_cache_reused_tokens_total") == reused + cached[1] + cached[2]
    assert server.metric("snapcompile_session_cache_entries") >= 3
    assert 0 < server.metric("snapcompile_session_cache_bytes")


def test_session_cache_bytes_option(artifact, tmp_path):
    for value in ("lots", "\u00b2", "2TB", "-1", "1e9"):       # "²" is a digit to str.isdigit
        bad = CliRunner().invoke(main, ["serve", str(artifact), "--session-cache-bytes", value])
        assert bad.exit_code == 2 and "expected 'auto', 0 or a size such as 512MiB" in bad.output, value
    from snapcompile.cli.options import parse_session_cache
    assert [parse_session_cache(None, None, v) for v in ("2GB", "2GiB", "512MB", "auto")] == [2 * 10**9, 2 * 2**30,
                                                                                            512 * 10**6, None]
    process = ServerProcess(artifact, "--session-cache-bytes", "0", log=tmp_path / "off.log").wait_ready()
    try:
        body = {"model": "tiny", "prompt": "the lazy dog " * 12, "max_tokens": 4, "temperature": 0}
        first = httpx.post(process.url + "/v1/completions", json=body, timeout=60).json()
        body["prompt"] += first["choices"][0]["text"] + " and the quick brown fox " * 4
        second = httpx.post(process.url + "/v1/completions", json=body, timeout=60).json()
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}, second
        assert process.metric("snapcompile_session_cache_hits_total") == 0
        ready = [line for line in (tmp_path / "off.log").read_text().splitlines() if line.startswith("ready: ")]
        assert ready == [f"ready: serving tiny at {process.url}/v1 (tiny-llama, snapstream B=64, 4 slots, "
                         "max context 512, no session store)"], ready
    finally:
        assert process.stop() == 0


@pytest.mark.parametrize("keep", ["full", "quantized"])
def test_session_keep_full_or_quantized_resumes_from_the_first_turn(snap_artifact, tmp_path, keep):
    """serve --session-keep full (quantized) on a compressed artifact: the follow-up resumes from
    the whole first prompt and answers as an engine with the same store does."""
    from snapcompile import Engine, Request
    bad = CliRunner().invoke(main, ["serve", str(snap_artifact), "--session-keep", "everything"])
    assert bad.exit_code == 2 and "'full', 'slot', 'quantized'" in bad.output
    engine = Engine.from_artifact(snap_artifact, session_cache_bytes=2**26, session_keep=keep)
    process = ServerProcess(snap_artifact, "--session-keep", keep, log=tmp_path / "full.log").wait_ready()
    try:
        body = {"model": "tiny", "prompt": "the lazy dog " * 12, "max_tokens": 4, "temperature": 0,
                "cache_salt": "one user"}
        for _ in range(2):
            reply = httpx.post(process.url + "/v1/completions", json=body, timeout=60).json()
            assert "choices" in reply, reply
            ids = engine.tokenizer.encode(body["prompt"], add_special_tokens=False)
            expected, = engine.generate([Request(ids, max_new_tokens=4)])
            assert reply["choices"][0]["text"] == expected.text
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == expected.cached_tokens
            body["prompt"] += reply["choices"][0]["text"] + " and the quick brown fox " * 4
        assert expected.cached_tokens > len(engine.sessions.newest().token_ids) // 2, "resumed from the first"
    finally:
        assert process.stop() == 0


def test_bench_serve_conversations_report_ttft_and_resumed_tokens_per_turn(server, artifact, tmp_path):
    """--turns 3: each client resends its conversation; the server's prompt and resumed token counts
    per turn are those of `run` on the saved conversations (the same prompts, the same store rule)."""
    out, prompts = tmp_path / "bs.json", tmp_path / "conversations.jsonl"
    result = CliRunner().invoke(main, ["bench-serve", server.url, "--model", "tiny", "--requests", "2",
                                       "--concurrency", "2", "--prompt-tokens", "100", "--output-tokens", "5",
                                       "--turns", "3", "--follow-up-tokens", "5,40", "--tokenizer", str(artifact),
                                       "--save-prompts", str(prompts), "-o", str(out), "--json"],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    per_turn = json.loads(out.read_text())["summary"]["per_turn"]
    assert [t["turn"] for t in per_turn] == [1, 2, 3] and all(t["completed"] == 2 for t in per_turn)
    same = CliRunner().invoke(main, ["run", str(artifact), "--prompts", str(prompts), "--max-new-tokens", "5",
                                     "--ignore-eos", "--json"], catch_exceptions=False)
    rows = json.loads(same.output.strip().splitlines()[-1])["results"]
    for turn in per_turn:
        mine = [r for r in rows if r["turn"] == turn["turn"]]
        assert turn["prompt_tokens_mean"] == sum(r["prompt_tokens"] for r in mine) / 2
        assert turn["cached_tokens_mean"] == sum(r["cached_tokens"] for r in mine) / 2
    tokens = [t["prompt_tokens_mean"] for t in per_turn]
    assert tokens[0] == 100 < tokens[1] < tokens[2]
    table = out.with_suffix(".md").read_text()
    assert "Conversations of 3 turns" in table and table.startswith("2 conversations of 3 turns (6 requests),")
    assert "| 6 | 0 |" in table                     # completed, failed: the requests the header counts


def test_bench_serve_follow_ups_are_drawn_within_their_bounds():
    from snapcompile.errors import SnapcompileError
    from snapcompile.serve.load_client import ServeBenchConfig
    config = ServeBenchConfig("http://x", "m", requests=3, prompt_tokens=500, turns=4, follow_up_tokens=(5, 200))
    lengths = config.part_lengths()
    assert lengths[::4] == [500] * 3 and len(lengths) == 12
    later = [n for i, n in enumerate(lengths) if i % 4]
    assert all(5 <= n <= 200 for n in later) and len(set(later)) > 4
    assert ServeBenchConfig("http://x", "m", requests=2, turns=3).part_lengths() == [2000] * 6
    with pytest.raises(SnapcompileError, match="follow-up-tokens"):
        ServeBenchConfig("http://x", "m", turns=3, follow_up_tokens=(50, 10))


def test_kept_caches_are_shared_only_within_a_partition(artifact, tmp_path):
    """The store's tenant isolation (docs/serving.md, "Who shares kept caches"): a client that sends
    another's prompt prefix learns nothing through cached_tokens unless both send the same
    cache_salt; without a salt (and without an API key) nothing is kept with --session-sharing
    private, everything shared with shared and with the default (auto) on loopback; with an API key
    its holders share."""
    secret = "Our system prompt. The user's PIN is 4071 and must stay private. " * 3
    guess = "Our system prompt. The user's PIN is 4071 and must stay private. " * 3 + "What is it?"

    def cached(url, prompt, salt=None, key=None):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        reply = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60).json()
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    with ServerProcess(artifact, "--session-sharing", "private", log=tmp_path / "private.log") as private:
        assert cached(private.url, secret, salt="alice") == 0
        assert cached(private.url, guess, salt="mallory") == 0                # another partition: nothing shown
        assert cached(private.url, guess) == 0                                # no salt, no key: private
        cached(private.url, secret)
        assert cached(private.url, guess) == 0                                # ... and nothing was kept
        assert cached(private.url, guess, salt="alice") > 0                   # the same salt resumes
        assert private.metric("snapcompile_session_cache_entries") == 3       # alice's two, mallory's one
    with ServerProcess(artifact, "--session-sharing", "shared", log=tmp_path / "shared.log") as shared:
        cached(shared.url, secret)
        assert cached(shared.url, guess) > 0                                  # opted in: unsalted clients share
        assert cached(shared.url, guess, salt="mallory") == 0                 # a salt is a partition of its own
    with ServerProcess(artifact, log=tmp_path / "auto.log") as local:        # the default on loopback: one user's
        cached(local.url, secret)
        assert cached(local.url, guess) > 0                                   # a plain client gets its cache back
    assert "kept caches: shared by every client that sends no cache_salt" in (tmp_path / "auto.log").read_text()
    from snapcompile.serve.partitions import resolve_sharing
    assert [resolve_sharing("auto", loopback, key) for loopback, key in ((True, False), (True, True), (False, False))] \
        == ["shared", "private", "private"]
    assert resolve_sharing("private", True, False) == "private" and resolve_sharing("shared", False, True) == "shared"
    with ServerProcess(artifact, "--api-key", "k3y", log=tmp_path / "key.log") as keyed:
        cached(keyed.url, secret, key="k3y")
        assert cached(keyed.url, guess, key="k3y") > 0                        # the key's holders share
        assert cached(keyed.url, guess, salt="x", key="k3y") == 0


def test_cache_salt_is_bounded(server):
    for salt in ("", "s" * 257, 7):
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "cache_salt": salt}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 400 and "cache_salt" in response.text, (salt, response.text)


def test_a_tool_killed_with_sigkill_leaves_no_server_behind(artifact):
    """A process that started `serve` through ServerProcess (as eval-ruler does) dies by SIGKILL: its
    server gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and exits."""
    import os
    import signal
    import subprocess
    import sys
    script = ("import sys, time\nfrom pathlib import Path\nfrom snapcompile.serve.process import ServerProcess\n"
              "server = ServerProcess(Path(sys.argv[1])).wait_ready()\nprint(server.process.pid, flush=True)\n"
              "time.sleep(600)\n")
    tool = subprocess.Popen([sys.executable, "-c", script, str(artifact)], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(tool.stdout.readline())
        os.kill(tool.pid, signal.SIGKILL)
        tool.wait(10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _alive(server_pid):
            time.sleep(0.2)
        assert not _alive(server_pid), "the server outlived the tool that started it"
    finally:
        tool.kill()


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, already exited but not yet reaped by init, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _from(address: str) -> httpx.Client:
    """An HTTP client whose connections come from `address` (any 127.x.y.z reaches the loopback server)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=60)


def _unread_stream(port: int, address: str, prompts: int = 16) -> socket.socket:
    """A raw client from `address` with a tiny receive window that asks for `prompts` long streamed
    answers with log probabilities (~3 MB in all, more than the socket buffers hold) and reads
    nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.bind((address, 0))
    sock.connect(("127.0.0.1", port))
    payload = json.dumps({"model": "tiny", "prompt": [f"go {i}" for i in range(prompts)], "max_tokens": 480,
                          "ignore_eos": True, "stream": True, "logprobs": 5}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    return sock


def test_one_address_cannot_hold_the_connections_or_requests_of_others(artifact, tmp_path):
    """An address holding idle connections past --max-connections-per-client has the extra ones
    closed at once, and one with --max-requests-per-client requests in flight (a stream it does not
    read) gets 429 for more; a client from another address is served meanwhile, and the address is
    served again once its requests end."""
    server = ServerProcess(artifact, "--max-connections-per-client", "4", "--max-requests-per-client", "16",
                           "--max-connections", "8", log=tmp_path / "log").wait_ready()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(4)]
    try:
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        try:
            assert extra.recv(1) == b"", "a connection past the address's share was kept open"
        except ConnectionResetError:
            pass
        extra.close()
        with _from("127.0.0.2") as other:
            assert other.post(server.url + "/v1/completions", json=body).status_code == 200
    finally:
        for sock in idle:
            sock.close()
    with _from("127.0.0.3") as busy, _from("127.0.0.2") as other:
        unread = _unread_stream(server.port, "127.0.0.3")
        time.sleep(1)
        refused = busy.post(server.url + "/v1/completions", json=body)
        assert refused.status_code == 429 and "--max-requests-per-client" in refused.json()["error"]["message"]
        assert other.post(server.url + "/v1/completions", json=body).status_code == 200
        too_many = other.post(server.url + "/v1/completions", json={**body, "prompt": ["a"] * 17})
        assert too_many.status_code == 400
        unread.close()
        deadline = time.monotonic() + 10
        while (status := busy.post(server.url + "/v1/completions", json=body).status_code) == 429:
            assert time.monotonic() < deadline, "the closed stream's requests were never given back"
            time.sleep(0.2)
        assert status == 200
    assert server.stop() == 0


def test_forwarded_headers_count_only_from_named_proxies(artifact, tmp_path):
    """X-Forwarded-For from a loopback peer is ignored by default (a header cannot make one client
    many); with --forwarded-allow-ips naming the peer, it names the client the bounds count."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    forwarded = {"X-Forwarded-For": "10.1.2.3"}
    for proxies, expected in (((), 429), (("--forwarded-allow-ips", "127.0.0.3"), 200)):
        server = ServerProcess(artifact, "--max-requests-per-client", "16", *proxies,
                               log=tmp_path / f"log{len(proxies)}").wait_ready()
        with _from("127.0.0.3") as client:
            unread = _unread_stream(server.port, "127.0.0.3")
            time.sleep(1)
            reply = client.post(server.url + "/v1/completions", json=body, headers=forwarded)
            assert reply.status_code == expected, (proxies, reply.text)
            unread.close()
        assert server.stop() == 0
    refused = CliRunner().invoke(main, ["serve", str(artifact), "--forwarded-allow-ips", "10.0.0.0/8,proxy"])
    assert refused.exit_code == 2 and "'proxy' is not an IP address or network" in refused.output


def test_idle_connections_give_way_to_new_clients(artifact, tmp_path):
    """Every one of --max-connections held by idle sockets (connected, no request sent): a new client
    is served, the longest idle sockets closed to make room; busy connections are never closed."""
    server = ServerProcess(artifact, "--max-connections", "8", "--max-connections-per-client", "0",
                           log=tmp_path / "log").wait_ready()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    busy = socket.create_connection(("127.0.0.1", server.port), timeout=5)     # a request whose body is coming
    busy.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"model\": ")
    time.sleep(0.5)                                                # its head read: a request runs on it
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(7)]
    try:
        time.sleep(0.5)
        for address in ("127.0.0.2", "127.0.0.6"):
            with _from(address) as client:
                assert client.post(server.url + "/v1/completions", json=body).status_code == 200
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b"", "the longest idle connection was kept"
        busy.sendall(b" " * (1000 - len(b"{\"model\": ")))       # the body completes: answered, not closed
        busy.settimeout(10)
        assert busy.recv(12).startswith(b"HTTP/1.1 "), "a busy connection was closed"
    finally:
        for sock in [busy, *idle]:
            sock.close()
    assert server.stop() == 0


def test_a_client_that_stops_reading_loses_its_stream_after_the_send_timeout(artifact, tmp_path):
    """A client that reads nothing of a long streamed answer: after --send-timeout its connection is
    dropped (the rest of the answer never comes), the request no longer runs, and others are served."""
    server = ServerProcess(artifact, "--send-timeout", "1", log=tmp_path / "log").wait_ready()
    sock = _unread_stream(server.port, "127.0.0.1")
    try:
        time.sleep(6)                                          # the answers are written, the client reads nothing
        received, sock_open = b"", True
        sock.settimeout(5)
        try:
            while chunk := sock.recv(65536):
                received += chunk
            sock_open = False
        except ConnectionResetError:
            sock_open = False
        except TimeoutError:
            pass
        assert not sock_open, "the unread stream still holds its connection"
        assert b"[DONE]" not in received
        assert server.metric("snapcompile_requests_running") == 0
        assert httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        sock.close()
        assert server.stop() == 0


def test_large_bodies_of_small_lists_do_not_stall_the_server(artifact, tmp_path):
    """Two clients send 2.7 MiB bodies of small token-id lists back to back for 5 s: each is refused
    (more values than any request of this model needs, found in a worker process), and /health
    answers meanwhile with a median under 120 ms (parsed on threads of the serving process the median
    was 171-274 ms in studies/event_loop_probe.py, now 2-3 ms there). The clients are processes of
    their own, so the probe shares no GIL with them."""
    server = ServerProcess(artifact, log=tmp_path / "log").wait_ready()
    try:
        flooders = [subprocess.Popen([sys.executable, "-c", FLOOD, server.url, "5"], stdout=subprocess.PIPE, text=True)
                    for _ in range(2)]
        assert all(flooder.stdout.readline() == "sending\n" for flooder in flooders)
        stop, waits = time.monotonic() + 5, []
        while time.monotonic() < stop:
            begin = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            waits.append(time.monotonic() - begin)
            time.sleep(0.02)
        refusals = [tuple(reply) for flooder in flooders for reply in json.loads(flooder.communicate(timeout=60)[0])]
        assert refusals and all(status == 400 and "JSON values" in message for status, message in refusals)
        assert sorted(waits)[len(waits) // 2] < 0.12, sorted(waits)
    finally:
        assert server.stop() == 0


FLOOD = """
import json, sys, time
import httpx
body = json.dumps({"model": "tiny", "prompt": [[1, 2, 3]] * 260_000, "max_tokens": 1}).encode()
stop, replies = time.monotonic() + float(sys.argv[2]), []
print("sending", flush=True)
with httpx.Client(timeout=60) as sender:
    while time.monotonic() < stop:
        reply = sender.post(sys.argv[1] + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
        replies.append((reply.status_code, reply.json()["error"]["message"]))
print(json.dumps(replies))
"""


def test_per_client_bounds_count_an_ipv6_network_as_one_client():
    from snapcompile.serve.limits import client_of
    assert client_of("2001:db8:1:2::5") == client_of("2001:db8:1:2:ffff::1") == "2001:db8:1::/56"
    assert client_of("2001:db8:1:ff::5") == client_of("2001:db8:1:2::5")       # 256 /64s of one subscriber
    assert client_of("2001:db8:1:100::5") != client_of("2001:db8:1:2::5")
    assert client_of("::ffff:10.0.0.7") == "10.0.0.7" == client_of("10.0.0.7")
    assert client_of("10.0.0.8") != client_of("10.0.0.7") and client_of("testclient") == "testclient"


@pytest.mark.parametrize("fields", [
    {"repetition_penalty": 50.0}, {"presence_penalty": -2.0}, {"frequency_penalty": -2.0}, {"logit_bias": {"65": 100}},
    {"temperature": 1.0, "seed": 5, "top_k": 3}, {"temperature": 1.0, "seed": 5, "min_p": 0.5}])
def test_every_sampling_parameter_is_honoured(server, artifact, fields):
    """Each parameter reaches the engine (the server's text equals the Python API's with the same
    SamplingParams) and has an effect (the text differs from the same request without it; the
    random tiny model rarely repeats a token, so the penalties are given the sign that makes it)."""
    from snapcompile import Engine, Request, SamplingParams
    prompt = "".join(map(chr, range(32, 127)))      # most byte tokens: the repetition penalty has work
    plain = {key: value for key, value in fields.items() if key in ("temperature", "seed")}
    engine = Engine.from_artifact(artifact, session_cache_bytes=0)

    def engine_text(**sampling):
        bias = tuple((int(k), float(v)) for k, v in sampling.pop("logit_bias", {}).items())
        request = Request(engine.encode(prompt, chat=False), max_new_tokens=24,
                          sampling=SamplingParams(**sampling, logit_bias=bias))
        return engine.generate([request])[0].text

    def served(**body):
        reply = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, **body})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]
    assert served(**fields) == engine_text(**fields)
    assert served(**fields) != served(**plain)


@pytest.mark.parametrize("field, value", [("typical_p", 0.5), ("repeat_penalty", 1.1), ("min_tokens", 4),
                                          ("guided_json", {"type": "object"}), ("logit_bias", {"x": 1}),
                                          ("logit_bias", {"999999": 1}), ("min_p", 2), ("top_k", -2)])
def test_a_sampling_field_not_honoured_is_refused_by_name(server, field, value):
    reply = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2, field: value})
    assert reply.status_code == 400 and field in json.dumps(reply.json()["error"]), reply.text


def test_tokenize_and_detokenize_in_vllm_and_llama_server_shapes(server, artifact):
    from snapcompile import Engine
    engine = Engine.from_artifact(artifact, session_cache_bytes=0)
    text = "The quick brown fox"
    ids = engine.encode(text, chat=False)
    for body in ({"prompt": text}, {"content": text, "model": "tiny"}):
        reply = httpx.post(server.url + "/tokenize", json=body, timeout=30).json()
        assert reply["tokens"] == ids and reply["count"] == len(ids) and reply["max_model_len"] == 512
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()
    assert chat["tokens"] == engine.encode(text, chat=True)
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()
    assert back["prompt"] == back["content"] == text
    for path, body, fragment in (("/tokenize", {"prompt": "a", "content": "b"}, "exactly one"),
                                 ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
                                 ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_special": True},
                                  "add_special"),
                                 ("/tokenize", {"prompt": "a", "model": "other"}, "does not exist"),
                                 ("/detokenize", {"tokens": [999999]}, "tokens must be"),
                                 ("/detokenize", {"tokens": "abc"}, "tokens")):
        reply = httpx.post(server.url + path, json=body, timeout=30)
        assert reply.status_code in (400, 404) and fragment in reply.json()["error"]["message"], reply.text


def test_a_max_tokens_past_what_the_model_can_generate_is_refused_with_the_counts(client):
    """Not capped silently: the 400 names the field, the prompt's tokens and the most that can follow
    (the tiny SnapStream artifact: the model's 4096 positions)."""
    prompt = [5] * 100
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as refused:
            if field == "max_tokens":
                client.completions.create(model="tiny", prompt=prompt, max_tokens=100000)
            else:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_completion_tokens=100000)
        body = refused.value.body
        assert body["param"] == field and body["code"] == "context_length_exceeded", body
        assert f"{field}=100000" in body["message"] and "the model can generate at most" in body["message"]
    fits = client.completions.create(model="tiny", prompt=prompt, max_tokens=4096 - 100 + 1, extra_body={
        "ignore_eos": True})
    assert fits.usage.completion_tokens == 3997 and fits.choices[0].finish_reason == "length"


def test_several_model_names_cors_and_template_fields_refused_by_name(artifact, tmp_path):
    """--served-model-name repeated: every name accepted, listed, and echoed back (the first when a
    request names none); /v1/models/{id}; a browser's CORS preflight from an allowed origin is answered
    (and not from another); chat-template fields this server does not honour are refused by name."""
    server = ServerProcess(artifact, "--served-model-name", "alias", "--allowed-origins", "http://localhost:3000",
                           log=tmp_path / "log").wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny", "alias"]
        assert client.models.retrieve("alias").id == "alias"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("other")
        for name in ("tiny", "alias"):
            reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2)
            assert reply.model == name
        preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        allowed = httpx.options(server.url + "/v1/chat/completions", headers=preflight, timeout=30)
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = httpx.options(server.url + "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.test"},
                              timeout=30)
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        simple = httpx.get(server.url + "/v1/models", headers={"Origin": "http://localhost:3000"}, timeout=30)
        assert simple.headers["access-control-allow-origin"] == "http://localhost:3000"
        with pytest.raises(openai.BadRequestError) as refused:       # a client's own template: not run
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body={"chat_template": "{{ messages }}"})
        assert refused.value.body["param"] == "chat_template"
    finally:
        assert server.stop() == 0
    for bad in ("localhost:3000", "http://x/path"):
        result = CliRunner().invoke(main, ["serve", str(artifact), "--allowed-origins", bad])
        assert result.exit_code == 2 and "is not an origin" in result.output


def test_tokenize_takes_a_chats_tools_as_the_chat_completion_does(server):
    """/tokenize with messages and tools (and tool_choice) counts the prompt a chat completion with
    the same fields feeds the model (its usage.prompt_tokens); tools without messages are a 400."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    counts = {}
    for choice in ("auto", "required", "none"):
        body = {"messages": messages, "tools": tools, "tool_choice": choice}
        counted = httpx.post(server.url + "/tokenize", json=body, timeout=30)
        assert counted.status_code == 200, counted.text
        answer = httpx.post(server.url + "/v1/chat/completions", json={**body, "model": "tiny", "max_tokens": 1},
                            timeout=60).json()
        counts[choice] = counted.json()["count"]
        assert counts[choice] == answer["usage"]["prompt_tokens"], choice
    plain = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    assert plain["count"] == counts["none"] < counts["auto"]
    refused = httpx.post(server.url + "/tokenize", json={"prompt": "a", "tools": tools}, timeout=30)
    assert refused.status_code == 400 and "give them with messages" in refused.json()["error"]["message"]


def test_the_serving_process_imports_neither_torch_nor_transformers(artifact, tmp_path):
    """The tokenizer and chat template are read with `tokenizers` and jinja2 (FileTokenizer), the
    grammar's token table too: a chat completion, a JSON-schema one and a detokenize go through a
    server that never imports transformers or torch (`python -X importtime` lists every import)."""
    from snapcompile.serve.process import SERVE
    log = tmp_path / "imports.log"
    process = ServerProcess(artifact, log=log, launcher=("-X", "importtime", *SERVE)).wait_ready()
    try:
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": schema}})
        assert httpx.post(process.url + "/detokenize", json={"tokens": [104, 105]}, timeout=30).status_code == 200
    finally:
        assert process.stop() == 0
    modules = {line.rsplit("|", 1)[-1].strip() for line in log.read_text().splitlines()
               if line.startswith("import time:")}
    assert "snapcompile.serve.app" in modules and "llguidance" in modules
    assert not {m.split(".")[0] for m in modules} & {"transformers", "torch"}


def test_n_samples_share_one_prefill_and_equal_separate_requests(server, client, artifact):
    """n=3 with a seed: choices 0..2 are the texts of three separate requests with seeds s, s+1,
    s+2; usage counts the prompt once; streamed chunks carry each choice's index (and a chat
    opens every choice with its role)."""
    prompt = "the quick brown fox " * 5
    replies = [client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=1.0, seed=7 + j)
               for j in range(3)]
    separate = [one.choices[0].text for one in replies]
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=1.0, seed=7, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2] and [c.text for c in reply.choices] == separate
    assert reply.usage.prompt_tokens == replies[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(one.usage.completion_tokens for one in replies)
    pieces: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=1.0, seed=7, n=3,
                                           stream=True):
        for choice in chunk.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + choice.text
    assert [pieces[j] for j in range(3)] == separate
    roles = [chunk.choices[0].index for chunk in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2, stream=True)
        if chunk.choices and chunk.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    assert server.metric("snapcompile_slots_in_use") == 0


def test_structured_output_through_the_openai_client(server, client):
    """`chat.completions.parse` with a pydantic model (the SDK sends response_format json_schema and
    validates the answer): the random tiny model's answers come back as validated objects; JSON mode
    answers a JSON object or ends by length; a schema llguidance refuses is a 400 naming
    response_format."""
    from typing import Literal

    import pydantic

    class Answer(pydantic.BaseModel):
        colour: Literal["red", "green", "blue"]
        ok: bool

    for seed in range(4):
        reply = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": f"pick {seed}"}],
                                              response_format=Answer, max_tokens=48, temperature=1.0, seed=seed)
        assert reply.choices[0].finish_reason == "stop" and isinstance(reply.choices[0].message.parsed, Answer)
    mode = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json"}],
                                          response_format={"type": "json_object"}, max_tokens=40, temperature=0)
    if mode.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(mode.choices[0].message.content), dict)
    else:
        assert mode.choices[0].finish_reason == "length" and mode.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert refused.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="no JSON value satisfies this schema"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"$ref": "#"}}})
    with pytest.raises(openai.BadRequestError, match="stop strings cannot be combined"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       stop=["}"], response_format={"type": "json_object"})


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city", "celsius"], "additionalProperties": False,
                   "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}}}}}


@pytest.fixture(scope="module")
def long_artifact(tiny_llama, tmp_path_factory):
    """A 2048-position tiny artifact (the byte-level tokenizer spends a token a character, and a
    tools prompt has a few hundred)."""
    return build_artifact(tiny_llama, tmp_path_factory.mktemp("tools") / "tiny", ExportConfig(slots=2,
                          max_context=2048, chunk=64), TINY_SNAPSTREAM)


@pytest.fixture(scope="module")
def long_client(long_artifact, tmp_path_factory):
    """A server on long_artifact."""
    process = ServerProcess(long_artifact, log=tmp_path_factory.mktemp("log") / "tools.log").wait_ready()
    yield openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert process.stop() == 0


def test_a_tool_call_round_trip_through_the_openai_client(long_client):
    """tool_choice "required": the answer is a tool call whose arguments follow the tool's schema
    (finish_reason tool_calls); the call and its result sent back, tool_choice "none" gives a text
    answer; "auto" answers either a call or text, both well formed, a cut one text (never the JSON
    wrapper); streamed, the call comes as OpenAI's deltas (id and name first, then the arguments in
    pieces) that the SDK's stream accumulator assembles into the same message."""
    client = long_client
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL],
                                           tool_choice="required", max_tokens=128, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Oslo")
    assert isinstance(arguments["celsius"], bool) and call.id.startswith("call_")
    history = messages + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    final = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER_TOOL], tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert final.choices[0].message.tool_calls is None and isinstance(final.choices[0].message.content, str)
    for seed in range(3):
        auto = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL], max_tokens=128,
                                              temperature=1.0, seed=seed).choices[0]
        assert (auto.finish_reason == "tool_calls" and auto.message.tool_calls) or \
            (auto.finish_reason in ("stop", "length") and isinstance(auto.message.content, str))
        cut = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL], max_tokens=6,
                                             temperature=1.0, seed=seed).choices[0]
        assert not (cut.message.content or "").startswith("{")        # a cut answer's text, not the wrapper
    with client.chat.completions.stream(model="tiny", messages=messages, tools=[WEATHER_TOOL], tool_choice="required",
                                        max_tokens=128, temperature=0) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.tool_calls[0].function.name == "get_weather"
    assert streamed.message.tool_calls[0].function.arguments == call.function.arguments
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=128, temperature=0,
        stream=True) if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].tool_calls[0].id.startswith("call_") and deltas[0].tool_calls[0].function.name == "get_weather"
    assert len(deltas) > 3 and all(d.tool_calls[0].id is None for d in deltas[1:])
    assert "".join(d.tool_calls[0].function.arguments or "" for d in deltas) == call.function.arguments
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL],
                                                 tool_choice="none", max_tokens=4, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_an_agent_framework_gets_a_validated_object(long_client):
    """pydantic-ai (its structured output calls a final_result tool with tool_choice required) on
    the random tiny model: the object comes back validated."""
    from typing import Literal

    import pydantic
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class City(pydantic.BaseModel):
        name: Literal["Paris", "Oslo"]
        sunny: bool

    model = OpenAIChatModel("tiny", provider=OpenAIProvider(base_url=str(long_client.base_url), api_key="unused"))
    result = Agent(model, output_type=City).run_sync("Which city, and is it sunny?",
                                                     model_settings={"temperature": 0, "max_tokens": 160})
    assert isinstance(result.output, City)


def test_torch_is_kept_out_only_where_nothing_served_needs_it(artifact, tmp_path):
    """A standard artifact on ONNX Runtime is served without torch; TensorRT and a plugin lowering
    (custom op nodes whose ONNX Runtime kernels are torch code) keep it; an unreadable manifest
    keeps it too (the error comes from read_manifest)."""
    import shutil

    from snapcompile.cli.serve import _needs_torch
    assert not _needs_torch(artifact, "ort") and _needs_torch(artifact, "trt")
    plugin = tmp_path / "plugin"
    shutil.copytree(artifact, plugin)
    manifest = json.loads((plugin / "manifest.json").read_text())
    (plugin / "manifest.json").write_text(json.dumps({**manifest, "lowering": "plugin"}))
    assert _needs_torch(plugin, "ort") and _needs_torch(tmp_path / "missing", "ort")


TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if thinking %}<think>{% endif %}{% endif %}")


def test_template_fields_are_honoured_as_transformers_renders_them(artifact, tmp_path):
    """--chat-template FILE replaces the artifact's template; add_generation_prompt false,
    continue_final_message (the text cut after the final assistant message) and chat_template_kwargs
    render as transformers' apply_chat_template does, on /tokenize and the chat completion alike."""
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    server = ServerProcess(artifact, "--chat-template", str(template), log=tmp_path / "server.log").wait_ready()
    try:
        def rendered(**fields) -> tuple[str, int]:
            tokens = httpx.post(server.url + "/tokenize", json=fields, timeout=30).json()["tokens"]
            return httpx.post(server.url + "/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"], \
                len(tokens)
        user = [{"role": "user", "content": "hi"}]
        started = [*user, {"role": "assistant", "content": "The sky is  "}]
        assert rendered(messages=user)[0] == "<user>hi</user><assistant>"
        assert rendered(messages=user, add_generation_prompt=False)[0] == "<user>hi</user>"
        thinking = rendered(messages=user, chat_template_kwargs={"thinking": True})[0]
        assert thinking == "<user>hi</user><assistant><think>"
        text, count = rendered(messages=started, continue_final_message=True, add_generation_prompt=False)
        assert text == "<user>hi</user><assistant>The sky is  "
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny", messages=started, max_tokens=3,
                                               extra_body={"continue_final_message": True,
                                                           "add_generation_prompt": False})
        assert reply.usage.prompt_tokens == count
        for fields, param in (({"messages": started, "continue_final_message": True}, "continue_final_message"),
                              ({"messages": user, "continue_final_message": True, "add_generation_prompt": False},
                               "continue_final_message"),
                              ({"messages": user, "chat_template_kwargs": {"messages": "x"}}, "chat_template_kwargs"),
                              ({"messages": user, "chat_template_kwargs": {"x": {"nested": 1}}},
                               "chat_template_kwargs.x"),
                              ({"messages": started, "continue_final_message": True, "add_generation_prompt": False,
                                "response_format": {"type": "json_object"}}, "continue_final_message")):
            response = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", **fields}, timeout=30)
            assert response.status_code == 400 and response.json()["error"]["param"].startswith(param), response.text
        for fields, param in (({"chat_template_kwargs": {"thinking": True}}, "chat_template_kwargs"),
                              ({"add_generation_prompt": False}, "add_generation_prompt"),
                              ({"continue_final_message": True}, "continue_final_message"),
                              ({"tools": [WEATHER_TOOL]}, "tools")):      # a text prompt has no template to shape
            response = httpx.post(server.url + "/tokenize", json={"prompt": "hi", **fields}, timeout=30)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    finally:
        assert server.stop() == 0
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    result = CliRunner().invoke(main, ["serve", str(artifact), "--chat-template", str(bad)])
    assert result.exit_code != 0 and "is not valid Jinja" in result.output


def test_info_log_has_a_line_a_request_and_the_drain(artifact, tmp_path):
    """--log-level info: each HTTP request's line (the response id the client got, tokens, TTFT, how it
    ended), streamed or not; snapcompile's own lines reach the log (the drain's at the stop)."""
    log = tmp_path / "server.log"
    server = ServerProcess(artifact, "--log-level", "info", log=log).wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        whole = client.completions.create(model="tiny", prompt=["a b c", "d e"], max_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True})
        streamed = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=2, stream=True))
    finally:
        assert server.stop() == 0
    text = log.read_text()
    line = next(line for line in text.splitlines() if f"request {whole.id}:" in line)
    assert "2 choices" in line and f"{whole.usage.prompt_tokens} prompt tokens (0 cached), 6 generated" in line
    assert "first token" in line and line.endswith("length,length")
    assert f"request {streamed[0].id}: 1 choice," in text and "draining:" in text


def test_reasoning_parser_gives_the_thinking_apart(artifact, client, tmp_path):
    """--reasoning-parser: a chat answer's text through serve.reasoning (its splitting is tested in
    tests/test_reasoning.py). The random model never closes a <think>, so with deepseek_r1 (thinking
    opened by the template) all of it is reasoning_content, streamed or not, and equals the answer a
    server without a parser gives as content; with qwen3 it stays content."""
    messages = [{"role": "user", "content": "Think first."}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    text = plain.choices[0].message.content
    assert "</think>" not in text and getattr(plain.choices[0].message, "reasoning_content", None) is None
    for parser, expected in (("deepseek_r1", (text, None)), ("qwen3", (None, text))):
        server = ServerProcess(artifact, "--reasoning-parser", parser, log=tmp_path / f"{parser}.log").wait_ready()
        try:
            other = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            whole = other.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
            message = whole.choices[0].message
            assert (message.reasoning_content, message.content) == expected
            chunks = list(other.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                         temperature=0, stream=True))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (expected[0] or "")
            assert "".join(d.content or "" for d in deltas) == (expected[1] or "")
        finally:
            assert server.stop() == 0


HERMES_TEMPLATE = (  # Qwen2.5's way, shortened: tools in the system turn, calls as <tool_call> blocks
    "{%- if tools %}<|system|>Tools: <tools>{% for t in tools %}{{ t.function.name }}{% endfor %}</tools>"
    "{% endif %}{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>"
    "{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{%- elif m.role == 'tool' %}<|tool|>{{ m.content }}"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|assistant|>"
    "{% endif %}")


def test_a_template_with_its_own_tool_format_renders_and_reads_it(long_artifact, tmp_path):
    """A Hermes-style template (it writes <tool_call>): with tool_choice auto the tools and the
    history's calls are rendered by the template itself, the answer is not constrained and is read
    in that format (the random model answers text: content, streamed as it comes); tool_choice
    required still answers a call, in the generic constrained format."""
    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    server = ServerProcess(long_artifact, "--chat-template", str(template), log=tmp_path / "server.log").wait_ready()
    try:
        history = [{"role": "user", "content": "Weather in Oslo?"},
                   {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Oslo", "celsius": true}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"}]
        tokens = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": [WEATHER_TOOL]},
                            timeout=30).json()["tokens"]
        prompt = httpx.post(server.url + "/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
        assert prompt == ('<|system|>Tools: <tools>get_weather</tools><|user|>Weather in Oslo?<|assistant|>'
                          '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}'
                          '</tool_call><|tool|>3 degrees<|assistant|>')
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        auto = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER_TOOL], max_tokens=24,
                                              temperature=0)
        assert auto.usage.prompt_tokens == len(tokens) and auto.choices[0].message.tool_calls is None
        assert auto.choices[0].finish_reason in ("stop", "length") and auto.choices[0].message.content
        chunks = list(client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER_TOOL],
                                                     max_tokens=24, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == auto.choices[0].message.content
        required = client.chat.completions.create(model="tiny", messages=history[:1], tools=[WEATHER_TOOL],
                                                  tool_choice="required", max_tokens=128, temperature=0)
        assert required.choices[0].finish_reason == "tool_calls"
        assert required.choices[0].message.tool_calls[0].function.name == "get_weather"
    finally:
        assert server.stop() == 0


def test_thinking_before_a_family_tool_call_is_split_off_first(long_artifact, tmp_path):
    """--reasoning-parser with a template of its own tool format: the answer's thinking is split off
    before its calls are read (Qwen3 thinks, then writes <tool_call>). The random model never closes
    its thinking, so with deepseek_r1 all of it is reasoning_content and no call or content is read
    from it, streamed or not; the generic constrained format (tool_choice required) is not split."""
    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    server = ServerProcess(long_artifact, "--chat-template", str(template), "--reasoning-parser", "deepseek_r1",
                           log=tmp_path / "server.log").wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        whole = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL], max_tokens=24,
                                               temperature=0).choices[0].message
        assert whole.reasoning_content and whole.content is None and whole.tool_calls is None
        deltas = [c.choices[0].delta for c in client.chat.completions.create(
            model="tiny", messages=messages, tools=[WEATHER_TOOL], max_tokens=24, temperature=0, stream=True)
            if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.reasoning_content
        assert not any(d.content or d.tool_calls for d in deltas)
        required = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL],
                                                  tool_choice="required", max_tokens=128, temperature=0)
        assert required.choices[0].message.tool_calls and required.choices[0].message.reasoning_content is None
    finally:
        assert server.stop() == 0


def test_gemma3_serves_completions_equal_to_run(tmp_path):
    """A model with sliding-window layers (tiny-gemma3: window rings in its local layer) through the
    server and the openai client: streamed or not, equal to `run`; a prompt extending the first
    one's conversation resumes from its kept cache (rings and all), as `run` answers it whole."""
    from snapcompile.models import load_model
    prompts = ["The quick brown fox jumps over the lazy dog. " * 6, "Once upon a time"]
    artifact = build_artifact(load_model("tiny-gemma3"), tmp_path / "gemma3", ExportConfig(slots=2, max_context=512,
                              chunk=64), TINY_SNAPSTREAM)
    expected = run_results(artifact, prompts, 12)
    log = tmp_path / "server.log"
    process = ServerProcess(artifact, log=log).wait_ready()
    try:
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt, row in zip(prompts, expected):
            whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
                model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True))
            assert whole.choices[0].text == streamed == row["text"]
        follow_up = prompts[0] + expected[0]["text"] + " And then the fox sat down to rest for a while."
        again = client.completions.create(model="tiny", prompt=follow_up, max_tokens=12, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert again.choices[0].text == run_results(artifact, [follow_up], 12)[0]["text"]
    finally:
        assert process.stop() == 0
