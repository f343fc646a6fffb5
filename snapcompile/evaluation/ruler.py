"""RULER's synthetic tasks through lm-evaluation-harness, against a running `snapcompile serve`.

lm-eval makes the RULER data itself (its own task files, sized with the artifact's tokenizer),
sends each prompt as token ids to the server's /v1/completions (`local-completions`, greedy) and
scores the answers with RULER's string match: nothing here writes, sends or scores a sample. Only
the tasks whose data needs no download are run (the essay, SQuAD and HotpotQA ones need one).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
from collections import deque
from pathlib import Path

from snapcompile.atomic import write_text_atomic

RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
DATA_SEED = 42                   # RULER's own data scripts' default random_seed
PREDICTION_CHARS = 400           # of each answer kept in the records
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
VT_MIN_LENGTH = 1024             # ruler_vt puts a worked example of up to 500 tokens before every sample
EXIT_STOPPED = 2


def build_seconds(length: int) -> float:
    """How long lm-eval may take to make one task's data at `length` tokens (SmolLM2's tokenizer:
    17-25 s a task at 512-4096 tokens, 2 cores)."""
    return 300.0 + length / 50


def offline_nltk(folder: Path) -> Path:
    """An nltk data folder under `folder` with an empty `tokenizers/punkt_tab`, put first on nltk's
    path. lm-eval's NIAH module looks `punkt_tab` up when it is imported and downloads it when it is
    missing; the tasks run here never split sentences (only the essay haystacks do), so the folder
    satisfies the look-up without the network, and a sentence split would fail loudly (the English
    tables are absent) rather than split differently."""
    root = Path(folder) / "nltk_data"
    (root / "tokenizers" / "punkt_tab").mkdir(parents=True, exist_ok=True)
    os.environ["NLTK_DATA"] = str(root)
    import nltk
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    return root


def go_offline() -> None:
    """No Hugging Face hub or dataset downloads from here on (the RULER data is made locally)."""
    os.environ.update(OFFLINE_ENV)


def tokenizer_folder(artifact: Path, folder: Path) -> Path:
    """A folder holding only the artifact's tokenizer files (sizes checked; `auto_map` refused), for
    lm-eval, which loads tokenizers with trust_remote_code on: with no Python file in the folder and
    the hub offline, nothing can be imported from it."""
    from snapcompile.artifact.files import check_files
    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.models.tokenizer import refuse_remote_code
    manifest = read_manifest(artifact)
    names = manifest.support_files()
    check_files(artifact, manifest, names)
    target = Path(folder) / "tokenizer"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in names:
        shutil.copyfile(Path(artifact) / name, target / name)
    refuse_remote_code(target)
    return target


def build_tasks(names: tuple[str, ...], tokenizer: Path, length: int) -> list:
    """lm-eval Task objects of `names`, their data made at `length` tokens (RULER's max_seq_length:
    prompt and answer together) with `tokenizer`. Made once per length and reused for every
    artifact, so that every artifact answers the same samples.

    lm-eval's RULER generators draw from Python's and numpy's global random state when the task is
    loaded; each task is loaded alone with both seeded (DATA_SEED), so the same task at the same
    length gets the same samples in every run, whatever else the run holds."""
    import random

    import numpy as np
    from lm_eval.tasks import TaskManager
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    manager = TaskManager(metadata={"tokenizer": str(tokenizer), "max_seq_lengths": [length]})
    tasks = []
    for name in names:
        random.seed(DATA_SEED)
        np.random.seed(DATA_SEED)
        printed = _LastLines()
        with contextlib.redirect_stdout(printed), _finished_within(build_seconds(length), printed,
                                                                   f"lm-eval's {name} data at {length} tokens"):
            tasks.append(manager.load([name])["tasks"][name])
    return tasks


class _LastLines:
    """A stdout that keeps the last `keep` lines written to it and drops the rest: lm-eval's RULER
    generators print a line per attempt (ruler_vt at too short a length printed 266 MB in 2 min)."""

    def __init__(self, keep: int = 20):
        self.lines: deque[str] = deque(maxlen=keep)
        self._partial = ""

    def write(self, text: str) -> int:
        *whole, self._partial = (self._partial + text).split("\n")
        self.lines.extend(line for line in whole if line.strip())
        return len(text)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def _finished_within(seconds: float, printed: _LastLines, what: str):
    """Stop the process (one error line on the process's stderr, whatever sys.stderr is redirected to,
    exit 2) if the block runs past `seconds`. lm-eval's RULER
    generators retry in `while True` loops under a bare `except:`, which swallows any exception a
    deadline or a signal could raise, so the process exits instead; a `serve` child follows it
    (serve.process stops children with their parent)."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        last = printed.lines[-1] if printed.lines else "nothing"
        message = f"error: {what} did not finish within {seconds:.0f} s (its last line: {last[:200]!r}); stopped\n"
        if sys.stderr is not sys.__stderr__:        # redirected (eval-ruler's lm-eval.log): it keeps the line too
            with contextlib.suppress(Exception):
                sys.stderr.write(message)
                sys.stderr.flush()
        os.write(2, message.encode())               # the process's own stderr: the user's terminal
        os._exit(EXIT_STOPPED)
    threading.Thread(target=watch, daemon=True, name="ruler-data-deadline").start()
    try:
        yield
    finally:
        done.set()


def evaluate_served(tasks: list, url: str, model: str, tokenizer: Path, length: int, max_length: int,
                    limit: int, concurrency: int, cache: Path, samples_path: Path) -> list[dict]:
    """Run `tasks` (from build_tasks at `length`) on the first `limit` samples each through
    lm-eval's local-completions against the server at `url`; returns one record per sample:
    task, doc_id, score (RULER's string match, in [0, 1]), prediction, target, input_sha.
    `cache`: lm-eval's request cache (a sqlite file), so a killed run resends only what it lacks.
    `samples_path`: lm-eval's own per-sample log (prompts, requests, answers), one JSON line each."""
    from lm_eval import simple_evaluate
    model_args = {"model": model, "base_url": f"{url}/v1/completions", "tokenizer": str(tokenizer),
                  "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_length": max_length,
                  "num_concurrent": concurrency, "max_retries": 1, "timeout": 3600}
    cache.parent.mkdir(parents=True, exist_ok=True)
    output = simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks, limit=limit,
                             log_samples=True, use_cache=str(cache), bootstrap_iters=0, verbosity="WARNING")
    samples = [(task, sample) for task, entries in sorted(output["samples"].items()) for sample in entries]
    write_text_atomic(samples_path, "".join(json.dumps(_log_entry(task, sample, length), default=str) + "\n"
                                            for task, sample in samples))
    return [_record(task, sample, length) for task, sample in samples]


def _log_entry(task: str, sample: dict, length: int) -> dict:
    """What lm-eval sent and got for one sample: the prompt (text lm-eval tokenized), the generation
    arguments, the raw answer and the score."""
    (context, gen_kwargs), = sample["arguments"]
    return {"task": task, "doc_id": sample["doc_id"], "input_sha": _input_sha(sample["doc"]), "context": context,
            "gen_kwargs": gen_kwargs, "answer": sample["resps"][0][0], "score": float(sample[str(length)]),
            "target": sample["doc"]["outputs"]}


def _record(task: str, sample: dict, length: int) -> dict:
    doc = sample["doc"]
    answer = sample["filtered_resps"][0] if sample.get("filtered_resps") else ""
    answer = answer[0] if isinstance(answer, list) else answer
    return {"task": task, "doc_id": sample["doc_id"], "score": float(sample[str(length)]),
            "prediction": str(answer)[:PREDICTION_CHARS], "target": list(doc["outputs"]),
            "input_sha": _input_sha(doc)}


def _input_sha(doc: dict) -> str:
    """A short hash of a sample's prompt: what tells that two cells (or a log and a record) hold the same sample."""
    return hashlib.sha256((doc["input"] + doc.get("gen_prefix", "")).encode()).hexdigest()[:16]
