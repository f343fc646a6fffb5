"""Chat templates and tokenization in worker processes, each job bounded in time and memory.

The chat template and the tokenizer are files of the artifact: a template can loop or allocate
without bound, a tokenizer's pre-tokenizer regex can be quadratic. On a thread neither can be
stopped (Rust code cannot be interrupted, a trace deadline does not bound allocation); a process
can (serve.workers). Each worker loads the artifact's tokenizer (without torch), runs under an
address-space limit of what it holds once loaded plus `headroom_bytes`, and answers one job at a
time. Workers come in two lanes with workers of their own, chat (template and tokenization) and
text (tokenization), so a request that needs no template never waits behind templates.
"""
from __future__ import annotations

from pathlib import Path

from snapcompile.prompts import TemplateOptions
from snapcompile.serve.workers import Lane, WorkerProcess, start_all

HEADROOM_BYTES = 2 * 2**30      # what a worker may allocate beyond its loaded tokenizer
LANES = ("chat", "text")
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}


class TokenizerPool:
    """`workers` processes per lane for the artifact in `folder`. `chat(messages, max_chars)` and
    `text(text)` return token ids or raise SnapcompileError; both block (call them from a worker
    thread) for at most `timeout_s`. Thread-safe."""

    def __init__(self, folder: Path, workers: int = 1, timeout_s: float = 10.0, headroom_bytes: int = HEADROOM_BYTES,
                 chat_template: Path | None = None):
        """chat_template: a Jinja file replacing the artifact's chat template (serve --chat-template)."""
        self.timeout_s = timeout_s
        args = [str(Path(folder)), str(headroom_bytes), str(chat_template or "")]
        self._lanes = {lane: Lane(lane, [_worker(args) for _ in range(workers)]) for lane in LANES}
        start_all(self._all_workers())

    def chat(self, messages: list[dict], max_chars: int | None = None,
             options: TemplateOptions | None = None) -> list[int]:
        """The token ids of `messages` through the chat template with `options`, rendered to at most
        `max_chars` characters."""
        return self._lanes["chat"].run(("chat", (messages, options or TemplateOptions()), max_chars), self.timeout_s,
                                       f"the chat template did not render within {self.timeout_s:g} s; refused")

    def text(self, text: str) -> list[int]:
        return self._lanes["text"].run(("text", text, None), self.timeout_s,
                                       f"the tokenizer did not finish within {self.timeout_s:g} s; refused")

    def pids(self) -> list[int]:
        """The worker processes running now."""
        return [worker.pid for worker in self._all_workers() if worker.pid is not None]

    def _all_workers(self) -> list[WorkerProcess]:
        return [worker for lane in self._lanes.values() for worker in lane.workers]

    def close(self) -> None:
        for worker in self._all_workers():
            worker.stop()


def _worker(args: list[str]) -> WorkerProcess:
    return WorkerProcess("tokenizer worker", "snapcompile.serve.tokenizer_worker", args, WORKER_ENV)


