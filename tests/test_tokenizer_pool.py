"""serve.tokenizer_pool: chat templates and tokenization in worker processes, bounded in time and memory."""
import os
import shutil
import signal
import threading
import time

import pytest

from snapcompile.artifact.files import artifact_tokenizer
from snapcompile.artifact.manifest import read_manifest
from snapcompile.errors import SnapcompileError
from snapcompile.prompts import encode_messages, encode_text
from snapcompile.serve.tokenizer_pool import TokenizerPool
from tests.cli_helpers import hostile_copy, rerecord_checksums
from tests.conftest import build_artifact


@pytest.fixture(scope="module")
def artifact(tiny_llama, tmp_path_factory):
    return build_artifact(tiny_llama, tmp_path_factory.mktemp("pool") / "tiny")


@pytest.fixture(scope="module")
def hostile(artifact, tmp_path_factory):
    return hostile_copy(artifact, tmp_path_factory.mktemp("hostile") / "tiny")


def test_the_workers_answer_as_the_tokenizer_in_process(artifact):
    tokenizer = artifact_tokenizer(artifact, read_manifest(artifact))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo, wörld"}]
    text = "The quick brown fox jumps over the lazy dog. " * 40 + "\u00e9\u4e2d"
    pool = TokenizerPool(artifact, timeout_s=30)
    try:
        assert pool.chat(messages) == encode_messages(tokenizer, messages)
        assert pool.text(text) == encode_text(tokenizer, text)
        assert len(pool.pids()) == 2
    finally:
        pool.close()
    assert pool.pids() == []


def test_a_template_is_bounded_in_time_memory_and_output(hostile):
    """A looping template: refused at the deadline, its worker replaced; a 3 GB string: refused by
    the worker's memory bound; a rendering past max_chars: refused before tokenizing; and the
    next request is answered each time."""
    pool = TokenizerPool(hostile, timeout_s=2, headroom_bytes=512 * 2**20)
    try:
        first = set(pool.pids())
        started = time.monotonic()
        with pytest.raises(SnapcompileError, match="did not render within 2 s"):
            pool.chat([{"role": "user", "content": "loop"}])
        assert time.monotonic() - started < 4
        assert pool.chat([{"role": "user", "content": "hi"}])
        assert set(pool.pids()) != first                     # the looping worker was killed and replaced
        with pytest.raises(SnapcompileError, match="out of memory"):
            pool.chat([{"role": "user", "content": "huge"}])
        with pytest.raises(SnapcompileError, match="rendered 30000000 characters"):
            pool.chat([{"role": "user", "content": "long"}], max_chars=100_000)
        assert pool.chat([{"role": "user", "content": "hi"}])
    finally:
        pool.close()


def test_a_quadratic_tokenizer_is_bounded_in_time_and_holds_only_its_lane(hostile):
    pool = TokenizerPool(hostile, timeout_s=2)
    try:
        expected = pool.text("hello")
        done = {}

        def tokenize():
            try:
                pool.text("a" * 100_000)
            except SnapcompileError as err:
                done["error"] = str(err)
        worker = threading.Thread(target=tokenize)
        quadratic_started = time.monotonic()
        worker.start()
        time.sleep(0.3)
        started = time.monotonic()
        assert pool.chat([{"role": "user", "content": "hi"}])     # the chat lane is not behind it
        assert time.monotonic() - started < 1
        try:          # the text lane is held until the quadratic job's deadline, not for its ~30 s
            assert pool.text("hello") == expected                  # by the worker replacing the killed one
        except SnapcompileError as err:                            # or refused at its own deadline
            assert "within 2 s" in str(err)
        assert 1.8 < time.monotonic() - quadratic_started < 4.5    # its deadline is 2 s after it began
        worker.join(10)
        assert "did not finish within 2 s" in done["error"]
        assert pool.text("ab") == pool.text("ab")
    finally:
        pool.close()


def test_a_worker_that_dies_fails_its_job_and_is_replaced(artifact):
    pool = TokenizerPool(artifact, timeout_s=30)
    try:
        for pid in pool.pids():
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(SnapcompileError, match="worker died"):
            pool.text("hello")
        assert pool.text("hello") == pool.text("hello")
    finally:
        pool.close()


def test_a_tokenizer_that_cannot_load_is_one_error_at_start(artifact, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(artifact, broken)
    (broken / "tokenizer.json").write_text("{}")
    rerecord_checksums(broken)
    with pytest.raises(SnapcompileError, match="tokenizer worker could not start"):
        TokenizerPool(broken, timeout_s=5)
