"""Runs an evaluation through the artifacts users deploy.

Artifacts are built once per configuration and cached (a dense export per model and shape set,
compressed ones derived from it); retrieval and fidelity cases run in their own modules, and every
finished case goes to the ResultStore, so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from snapcompile.artifact.manifest import read_manifest
from snapcompile.compiler.cache import ArtifactCache
from snapcompile.evaluation.config import EvalConfig, policy_for
from snapcompile.evaluation.fidelity import run_fidelity
from snapcompile.evaluation.partial_results import ResultStore
from snapcompile.evaluation.retrieval import run_retrieval
from snapcompile.evaluation.tasks import make_cases


def run_eval(config: EvalConfig, results_path: Path, cache_dir: Path, progress=None,
             log: Callable[[str], None] = print) -> list[dict]:
    """Run every pending case; returns all records (finished earlier or now)."""
    from snapcompile.artifact.files import artifact_tokenizer
    export = config.export
    cache = ArtifactCache(config.source, cache_dir, log)
    dense_dir = cache.dense(export)
    manifest = read_manifest(dense_dir)
    chat = manifest.chat and config.task != "fidelity"
    tokenizer = artifact_tokenizer(dense_dir, manifest)
    cases = make_cases(config.task, tokenizer, config.lengths, config.depths, config.samples, config.seed, chat)
    store = ResultStore(results_path, config)
    cells = {(p, b): [c for c in cases if config.applies(p, b, c)] for p, b in config.runs()}
    pending = {(p, b): [c for c in applied if not store.done(c, p, b)] for (p, b), applied in cells.items()}
    if progress:
        progress(sum(map(len, cells.values())) - sum(map(len, pending.values())), sum(map(len, cells.values())))
    if config.task == "fidelity":
        run_fidelity(config, cases, pending, cache, store, tokenizer, progress)
    else:
        for (policy, budget), todo in pending.items():
            if todo:
                folder = cache.get(export, policy_for(policy, budget, config.scope, config.kernel))
                run_retrieval(folder, todo, policy, budget, chat, store, progress)
    ids = [store.record_id(c, p, b) for (p, b), applied in cells.items() for c in applied]
    return [store.records[i] for i in ids if i in store.records]
