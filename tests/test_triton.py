"""Triton Inference Server: the repository `triton-repo` writes, served by the real tritonserver
binary of the nvidia-pytriton wheel, driven through the generate extension and tritonclient."""
import json
import queue
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from snapcompile.cli import main
from snapcompile.config import ExportConfig
from snapcompile.errors import SnapcompileError
from snapcompile.tritonserver import launch
from snapcompile.tritonserver.repository import MARKER, write_repository
from tests.conftest import TINY_SNAPSTREAM, build_artifact, run_results
from tests.server_process import free_port

PROMPTS = ["The quick brown fox", "hello world " * 8, "x y z", "the lazy dog " * 20]


@pytest.fixture(scope="module")
def artifact(tiny_llama, tmp_path_factory):
    return build_artifact(tiny_llama, tmp_path_factory.mktemp("triton") / "tiny4",
                          ExportConfig(slots=4, max_context=512, chunk=64), TINY_SNAPSTREAM)


class TritonProcess:
    def __init__(self, repository, workdir, log):
        self.http, self.grpc, self.metrics = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http}"
        self.workdir, self.log = workdir, open(log, "w+")
        self.process = launch.start(repository, workdir, "127.0.0.1", self.http, self.grpc, self.metrics,
                                    stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s=180):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self._log_tail()
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(self._log_tail())

    def generate(self, body, stream=False, timeout=120):
        return httpx.post(f"{self.url}/v2/models/tiny/generate{'_stream' if stream else ''}", json=body,
                          timeout=timeout)

    def stop(self):
        self.process.terminate()
        code = self.process.wait(90)
        self.log.close()
        return code

    def stubs_left(self):
        found = subprocess.run(["pgrep", "-f", f"{self.workdir}/tritonserver/backends/python"], capture_output=True)
        return found.stdout.decode().split()

    def _log_tail(self):
        self.log.seek(0)
        return self.log.read()[-3000:]


@pytest.fixture(scope="module")
def triton(artifact, tmp_path_factory):
    folder = tmp_path_factory.mktemp("repo")
    write_repository(artifact, folder / "repo", "tiny", instances=2, threads=1)
    server = TritonProcess(folder / "repo", folder / "work", folder / "triton.log").wait_ready()
    yield server
    assert server.stop() == 0
    assert server.stubs_left() == [], "no orphaned Python-backend stub processes"


@pytest.fixture(scope="module")
def run_texts(artifact):
    return [row["text"] for row in run_results(artifact, PROMPTS, 10)]


def test_repository_layout(artifact, tmp_path):
    info = write_repository(artifact, tmp_path / "repo", "tiny", instances=3, slots=2, threads=1, session_keep="full")
    config = (tmp_path / "repo" / "tiny" / "config.pbtxt").read_text()
    assert 'key: "threads" value: { string_value: "1" }' in config and info["threads"] == 1
    assert 'key: "session_keep" value: { string_value: "full" }' in config and info["session_keep"] == "full"
    assert 'backend: "python"' in config and "decoupled: true" in config and "count: 3 kind: KIND_CPU" in config
    assert 'name: "text_input" data_type: TYPE_STRING' in config and 'name: "text_output"' in config
    copied = tmp_path / "repo" / "tiny" / "1" / "artifact"
    assert (copied / "manifest.json").is_file() and not copied.is_symlink() and info["artifact_placed"] == "copied"
    assert (tmp_path / "repo" / "tiny" / "1" / "model.py").is_file() and (tmp_path / "repo" / MARKER).is_file()
    linked = write_repository(artifact, tmp_path / "linked", "tiny", link=True)
    assert (tmp_path / "linked" / "tiny" / "1" / "artifact").is_symlink() and linked["artifact_placed"] == "linked"
    with pytest.raises(SnapcompileError, match="already exists"):
        write_repository(artifact, tmp_path / "repo", "tiny")
    with pytest.raises(SnapcompileError, match="model name"):
        write_repository(artifact, tmp_path / "other", "bad name/")
    with pytest.raises(SnapcompileError, match="--slots must be in 1..4"):
        write_repository(artifact, tmp_path / "other", "tiny", slots=9)


def test_triton_repo_cli(artifact, tmp_path):
    result = CliRunner().invoke(main, ["triton-repo", str(artifact), "-o", str(tmp_path / "r"), "--instances", "2",
                                       "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["instances"] == 2
    again = CliRunner().invoke(main, ["triton-repo", str(artifact), "-o", str(tmp_path / "r")])
    assert again.exit_code == 2 and again.output.startswith("error: ") and "already exists" in again.output


def test_the_sampling_inputs_reach_the_engine(triton, artifact):
    """top_k, min_p, the penalties and logit_bias (JSON text) give the Python API's texts; a bad
    logit_bias is the request's error."""
    from snapcompile import Engine, Request, SamplingParams
    engine = Engine.from_artifact(artifact, session_cache_bytes=0)
    text = "".join(map(chr, range(32, 127)))
    for fields, sampling in (({"logit_bias": '{"65": 100}'}, SamplingParams(logit_bias=((65, 100.0),))),
                             ({"repetition_penalty": 50.0}, SamplingParams(repetition_penalty=50.0)),
                             ({"presence_penalty": -2.0, "frequency_penalty": -1.0},
                              SamplingParams(presence_penalty=-2.0, frequency_penalty=-1.0)),
                             ({"temperature": 1.0, "seed": 3, "top_k": 2, "min_p": 0.5},
                              SamplingParams(temperature=1.0, seed=3, top_k=2, min_p=0.5))):
        reply = triton.generate({"text_input": text, "max_tokens": 10, **fields})
        assert reply.status_code == 200, reply.text
        expected = engine.generate([Request(engine.encode(text, chat=False), max_new_tokens=10, sampling=sampling)])
        assert reply.json()["text_output"] == expected[0].text, fields
    bad = triton.generate({"text_input": text, "max_tokens": 2, "logit_bias": '{"999999": 1}'})
    assert bad.status_code != 200 and "logit_bias token ids" in bad.text


def test_generate_equals_run(triton, run_texts):
    for prompt, expected in zip(PROMPTS, run_texts):
        reply = triton.generate({"text_input": prompt, "max_tokens": 10, "temperature": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["text_output"] == expected and body["completion_tokens"] <= 10


def test_generate_stream_yields_the_same_text_token_by_token(triton, run_texts):
    reply = triton.generate({"text_input": PROMPTS[1], "max_tokens": 10, "stream": True}, stream=True)
    chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    assert len(chunks) > 2 and "".join(c["text_output"] for c in chunks) == run_texts[1]
    assert chunks[-1]["finish_reason"] in ("stop", "length") and "finish_reason" not in chunks[0]


def test_16_concurrent_requests_on_2_instances_and_a_bad_one(triton, artifact):
    from snapcompile import Engine, Request
    engine = Engine.from_artifact(artifact, session_cache_bytes=0)
    prompts = [f"request {i} " * (1 + i % 5) for i in range(16)]
    alone = [engine.generate([Request(engine.encode(p), max_new_tokens=6)])[0].text for p in prompts]
    bodies = [{"text_input": p, "max_tokens": 6} for p in prompts]
    bodies.insert(7, {"text_input": "", "max_tokens": 6})
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(triton.generate, bodies))
    bad = replies.pop(7)
    assert bad.status_code == 400 and "text_input is empty" in bad.json()["error"]
    assert [r.json()["text_output"] for r in replies] == alone
    too_long = triton.generate({"text_input": "x" * 600, "max_tokens": 2})
    assert too_long.status_code == 400 and "600 tokens" in too_long.json()["error"]


def _grpc_inputs(text, max_tokens, ignore_eos=False):
    import tritonclient.grpc as grpcclient
    text_input = grpcclient.InferInput("text_input", [1], "BYTES")
    text_input.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    limit = grpcclient.InferInput("max_tokens", [1], "INT64")
    limit.set_data_from_numpy(np.array([max_tokens], dtype=np.int64))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    no_eos = grpcclient.InferInput("ignore_eos", [1], "BOOL")
    no_eos.set_data_from_numpy(np.array([ignore_eos]))
    return [text_input, limit, stream, no_eos]


def _stream_client(server):
    import tritonclient.grpc as grpcclient
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}")
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    return client, results


def test_tritonclient_streams(triton, run_texts):
    client, results = _stream_client(triton)
    client.async_stream_infer("tiny", _grpc_inputs(PROMPTS[0], 10), request_id="a")
    pieces = []
    while True:
        result, error = results.get(timeout=60)
        assert error is None, error
        pieces.append(result.as_numpy("text_output")[0].decode())
        if result.get_response().parameters.get("triton_final_response").bool_param:
            break
    client.stop_stream()
    client.close()
    assert "".join(pieces) == run_texts[0]


def test_a_continued_text_resumes_the_instance_kept_cache(artifact, tmp_path):
    """One instance: a request that continues an earlier one's text resumes its kept cache
    (the cached_tokens output) and answers as an engine with the same store does."""
    from snapcompile import Engine, Request
    engine = Engine.from_artifact(artifact, session_cache_bytes=2**26)
    write_repository(artifact, tmp_path / "repo", "tiny", slots=2, threads=1)
    server = TritonProcess(tmp_path / "repo", tmp_path / "work", tmp_path / "triton.log").wait_ready()
    try:
        text, cached = "the lazy dog " * 12, []
        for more in (" and the quick brown fox " * 4, " then it rained for days " * 3):
            reply = server.generate({"text_input": text, "max_tokens": 8, "temperature": 0,
                                     "cache_salt": "one conversation"}).json()
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
            expected, = engine.generate([Request(ids, max_new_tokens=8)])
            assert reply["text_output"] == expected.text and reply["cached_tokens"] == expected.cached_tokens
            cached.append(reply["cached_tokens"])
            text += reply["text_output"] + more
        assert cached[0] == 0 and cached[1] >= 64, cached
        again = server.generate({"text_input": text, "max_tokens": 8, "temperature": 0}).json()
        assert again["cached_tokens"] == 0, "without a salt a repository of private sharing shares nothing"
        other = server.generate({"text_input": text, "max_tokens": 8, "cache_salt": "someone else"}).json()
        assert other["cached_tokens"] == 0
    finally:
        assert server.stop() == 0


def test_a_cancelled_request_frees_its_slot(artifact, tmp_path):
    """One instance with one slot: a long request holds it until the model's 4096 positions run
    out (max_tokens past 2^32 must not wrap to a small count). The request after a cancelled long
    one runs at once only if the cancellation freed it."""
    write_repository(artifact, tmp_path / "repo", "tiny", slots=1)
    server = TritonProcess(tmp_path / "repo", tmp_path / "work", tmp_path / "triton.log").wait_ready()
    try:
        started = time.monotonic()
        whole = server.generate({"text_input": "go", "max_tokens": 2**32 + 3, "ignore_eos": True}, timeout=300).json()
        uncancelled_s = time.monotonic() - started
        assert whole["completion_tokens"] > 4000 and whole["finish_reason"] == "length"
        client, results = _stream_client(server)
        client.async_stream_infer("tiny", _grpc_inputs("go", 1_000_000, ignore_eos=True), request_id="long")
        assert results.get(timeout=60)[1] is None
        client.stop_stream(cancel_requests=True)
        client.close()
        started = time.monotonic()
        reply = server.generate({"text_input": "after", "max_tokens": 3}, timeout=300)
        assert reply.status_code == 200 and reply.json()["completion_tokens"] == 3
        assert time.monotonic() - started < uncancelled_s / 4, "the cancelled request still held the slot"
    finally:
        assert server.stop() == 0
        assert server.stubs_left() == []


@pytest.mark.slow
def test_smollm2_on_triton(smol_snap, tmp_path):
    from snapcompile.models.tokenizer import load_tokenizer
    from snapcompile.passkeys import passkey_prompt
    write_repository(smol_snap, tmp_path / "repo", "tiny")
    server = TritonProcess(tmp_path / "repo", tmp_path / "work", tmp_path / "triton.log").wait_ready(600)
    chat = load_tokenizer(smol_snap).apply_chat_template(
        [{"role": "user", "content": passkey_prompt(48213, 1200, depth=0.3)}], add_generation_prompt=True,
        tokenize=False)                        # the generate extension takes text: the template is the client's
    try:
        reply = server.generate({"text_input": chat, "max_tokens": 24}, timeout=600)
        assert reply.status_code == 200 and "48213" in reply.json()["text_output"]
    finally:
        assert server.stop() == 0


def test_missing_tritonserver_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SnapcompileError, match=r'pip install "snapcompile\[triton\]"'):
        launch.prepare(tmp_path)


def test_bench_serve_drives_triton(triton, artifact, tmp_path):
    out = tmp_path / "bt.json"
    result = CliRunner().invoke(main, ["bench-serve", triton.url, "--api", "triton", "--model", "tiny",
                                       "--requests", "8", "--concurrency", "4", "--prompt-tokens", "40",
                                       "--output-tokens", "6", "--tokenizer", str(artifact), "-o", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())["summary"]
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (8, 0, 48)
    assert summary["total_prompt_tokens"] == 8 * 40 and summary["ttft_ms"]["p50"] is not None


class _StandInBackendUtils:
    """What TritonWorker uses of the Python backend's triton_python_backend_utils, recording responses."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

        def as_numpy(self):
            return self.array

    class TritonError:
        def __init__(self, message):
            self.message = message

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.output_tensors, self.error = output_tensors, error

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.inputs.get(name)


class _Sender:
    def __init__(self):
        self.sent, self.done = [], threading.Event()

    def send(self, response=None, flags=0):
        self.sent.append(response)
        if flags:
            self.done.set()


class _TritonRequest:
    def __init__(self, text):
        pb = _StandInBackendUtils
        self.inputs = {"text_input": pb.Tensor("text_input", np.array([text.encode()], dtype=np.object_)),
                       "max_tokens": pb.Tensor("max_tokens", np.array([4], dtype=np.int64))}
        self.sender = _Sender()

    def get_response_sender(self):
        return self.sender

    def is_cancelled(self):
        return False


def test_an_engine_step_fault_is_an_error_to_the_triton_client_not_a_cancel(artifact, monkeypatch):
    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.engine.core import EngineCore
    from snapcompile.tritonserver.worker import TritonWorker
    real_step = EngineCore.step

    def step(self):
        if self.scheduler.decoding:
            raise RuntimeError("planted step fault")
        return real_step(self)
    monkeypatch.setattr(EngineCore, "step", step)
    worker = TritonWorker(_StandInBackendUtils, artifact, read_manifest(artifact).fingerprint(), slots=None)
    try:
        request = _TritonRequest("hello")
        worker.submit(request)
        assert request.sender.done.wait(60)
        final = request.sender.sent[-1]
        assert final is not None and final.error is not None and "planted step fault" in final.error.message
        assert worker.loop.metrics.requests.labels("error")._value.get() == 1
        assert worker.loop.metrics.requests.labels("abort")._value.get() == 0
    finally:
        worker.stop()


@pytest.mark.parametrize("inputs, fragment", [
    ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, "text_input is not UTF-8 text"),
    ({"stop": np.array([b"[" * 100000], dtype=np.object_)}, "stop nests too deeply"),
    ({"stop": np.array([b"\xff"], dtype=np.object_)}, "stop is not UTF-8 text"),
    ({"temperature": np.array(["abc"], dtype=np.object_)}, "a request input has a wrong value"),
    ({"text_input": np.array([b"x" * 5_000_000], dtype=np.object_)}, "more than this model's context can hold"),
    ({"stop": np.array([b"q" * 1_500_000], dtype=np.object_)}, "a stop string may have at most 256 characters"),
])
def test_bad_triton_inputs_are_named_errors_not_exception_names(artifact, inputs, fragment):
    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.tritonserver.worker import TritonWorker
    worker = TritonWorker(_StandInBackendUtils, artifact, read_manifest(artifact).fingerprint(), slots=None)
    try:
        request = _TritonRequest("hello")
        request.inputs.update({name: _StandInBackendUtils.Tensor(name, value) for name, value in inputs.items()})
        worker.submit(request)
        assert request.sender.done.wait(10)
        assert fragment in request.sender.sent[-1].error.message
    finally:
        worker.stop()


def test_a_stop_string_that_only_looks_like_json_is_a_literal_stop(artifact):
    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.tritonserver.worker import TritonWorker
    worker = TritonWorker(_StandInBackendUtils, artifact, read_manifest(artifact).fingerprint(), slots=None)
    try:
        for stop, expected in ((b"[END]", ("[END]",)), (b'["a", "b"]', ("a", "b"))):
            request = _TritonRequest("hello")
            request.inputs["stop"] = _StandInBackendUtils.Tensor("stop", np.array([stop], dtype=np.object_))
            assert worker._stops(request) == expected
    finally:
        worker.stop()


@pytest.mark.parametrize("args, fragment", [
    (("--model-name", "abc\n"), "must be 1 to 128 letters"),
    (("--model-name", "a" * 300), "must be 1 to 128 letters"),
    (("--instances", 100000), "--instances must be in 1..64"),
])
def test_triton_repo_refuses_names_and_instance_counts_it_cannot_serve(artifact, tmp_path, args, fragment):
    from tests.cli_helpers import assert_one_line_error, invoke
    assert_one_line_error(invoke("triton-repo", artifact, "-o", tmp_path / "repo", *args), fragment)
    assert not (tmp_path / "repo").exists()
