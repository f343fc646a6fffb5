"""`eval-ruler`'s grid: RULER through lm-eval on served artifacts, per weight format, policy cell
and length, resumable.

A cell is "dense" or "POLICY/RATIO": at length L it runs the POLICY artifact with budget L // RATIO.
Every artifact is served once (`snapcompile serve`, a child process) for all the lengths it runs;
the tasks' data is made once per length and shared by every artifact. A finished (weights, cell,
length) unit goes to OUTPUT.partial.jsonl at once; a unit killed midway resends only the requests
that lm-eval's request cache lacks. lm-eval's own output goes to the work folder's lm-eval.log, each
server's to serve-<artifact>.log.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from snapcompile.config import POLICIES, SCOPES, WEIGHT_FORMATS, ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError, first_line
from snapcompile.evaluation import ruler
from snapcompile.evaluation.config import policy_for
from snapcompile.evaluation.partial_results import append_partial, config_defaults, read_partial, read_results
from snapcompile.evaluation.ruler_margin import margin_id, measure, read_log
from snapcompile.evaluation.ruler_report import lost_samples

DEFAULT_CELLS = ("dense", "snapstream/4", "snapstream/8", "streamingllm/4")
CONTEXT_MARGIN = 64        # positions beyond the longest length: lm-eval's gen_prefix rides on RULER's sizing
SERVER_START_S = 600       # for a server to load its graphs (int4 sessions pre-pack their weights)


@dataclass(frozen=True)
class RulerConfig:
    source: str                               # model name/path, or a dense artifact folder
    tasks: tuple[str, ...] = ruler.RULER_TASKS
    lengths: tuple[int, ...] = (2048, 4096)   # RULER's max_seq_length: prompt + answer tokens
    cells: tuple[str, ...] = DEFAULT_CELLS
    weights: tuple[str, ...] = ("fp32",)
    limit: int = 5                            # samples per task and length
    slots: int = 4                            # of every artifact; lm-eval sends this many requests at once
    chunk: int = ExportConfig.chunk          # the product's own shapes (convert's default)
    scope: str = "head"                       # SnapStream's selection scope (head | layer)
    kernel: int = PolicyConfig.kernel         # SnapStream's pooling kernel K
    kv_dtype: str = ExportConfig.kv_dtype     # the KV cache of every artifact, dense's too (--kv-dtype)

    def __post_init__(self):
        unknown = set(self.tasks) - set(ruler.RULER_TASKS)
        if unknown or not self.tasks:
            raise SnapcompileError(f"unknown RULER tasks: {', '.join(sorted(unknown)) or '(none given)'}; these "
                                   f"run offline: {', '.join(ruler.RULER_TASKS)}")
        for cell in self.cells:
            parse_cell(cell)
        if not self.cells:
            raise SnapcompileError("give at least one cell (--cells)")
        bad = set(self.weights) - set(WEIGHT_FORMATS)
        if bad or not self.weights:
            raise SnapcompileError(f"--weights must be among {', '.join(WEIGHT_FORMATS)}")
        if not self.lengths or min(self.lengths) < 512:
            raise SnapcompileError("--lengths must be token counts >= 512 (RULER's haystacks need room)")
        if "ruler_vt" in self.tasks and min(self.lengths) < ruler.VT_MIN_LENGTH:
            raise SnapcompileError(f"ruler_vt needs --lengths >= {ruler.VT_MIN_LENGTH}: lm-eval puts a worked example "
                                   "of up to 500 tokens before each sample, and its generator never ends when the "
                                   "sample cannot fit (leave ruler_vt out of --tasks for shorter lengths)")
        if self.limit < 1:
            raise SnapcompileError("--limit must be >= 1")
        if self.scope not in SCOPES:
            raise SnapcompileError(f"--scope must be one of {', '.join(SCOPES)}")
        PolicyConfig(kernel=self.kernel)      # raises on a kernel the policy refuses
        ExportConfig(kv_dtype=self.kv_dtype)  # and on a KV dtype the export refuses

    def export(self, weights: str) -> ExportConfig:
        return ExportConfig(slots=self.slots, max_context=max(self.lengths) + CONTEXT_MARGIN, chunk=self.chunk,
                            weight_format=weights, kv_dtype=self.kv_dtype)

    def units(self) -> list[tuple[str, str, int]]:
        """(weights, cell, length) for every run, dense first."""
        return [(w, c, n) for w in self.weights for c in sorted(self.cells, key=lambda c: c != "dense")
                for n in self.lengths]


def parse_cell(cell: str) -> tuple[str, int | None]:
    """'dense' -> ('dense', None); 'snapstream/4' -> ('snapstream', 4)."""
    match = re.fullmatch(r"(\w+)(?:/(\d+))?", cell)
    policy, ratio = (match.group(1), match.group(2)) if match else (None, None)
    if policy not in POLICIES or (policy == "dense") != (ratio is None) or (ratio is not None and int(ratio) < 2):
        compressed = ", ".join(p for p in POLICIES if p != "dense")
        raise SnapcompileError(f"cell {cell!r}: give 'dense' or POLICY/RATIO with POLICY among {compressed} and "
                               "RATIO >= 2 (budget = length // RATIO)")
    return policy, int(ratio) if ratio else None


def budget_of(cell: str, length: int) -> int | None:
    _, ratio = parse_cell(cell)
    return None if ratio is None else length // ratio


def unit_id(weights: str, cell: str, length: int) -> str:
    return f"{weights}|{cell}|{length}"


class UnitStore:
    """Finished units, and dense's margins on the samples they lost (ruler_margin), of an
    interrupted run of the same configuration (OUTPUT.partial.jsonl) and of OUTPUT itself (another
    configuration's results are refused, not overwritten)."""

    def __init__(self, results_path: Path, config: RulerConfig):
        from snapcompile.evaluation.partial_results import partial_path
        self.path = partial_path(results_path)
        self.config_json = json.dumps(asdict(config), sort_keys=True)
        self.units: dict[str, dict] = {}
        self.margins: dict[str, dict] = {}
        if Path(results_path).is_file():
            self._load_results(Path(results_path), config)
        for record in read_partial(self.path, self.config_json, "RULER"):
            self._file(record)

    def _load_results(self, path: Path, config: RulerConfig) -> None:
        stored, units, lost = read_results(path, "eval-ruler", "units", "lost")
        if {**config_defaults(RulerConfig), **stored} != json.loads(self.config_json):
            raise SnapcompileError(f"{path} holds RULER results of another configuration: delete it or change -o")
        self.units.update((unit["id"], unit) for unit in units)
        self.margins.update((margin_id(item), item["margin"]) for item in lost if "margin" in item)

    def _file(self, record: dict) -> None:
        if "margin" in record:
            self.margins[record["id"]] = record["margin"]
        else:
            self.units[record["id"]] = record

    def add(self, unit: dict) -> None:
        self._file(unit)
        append_partial(self.path, self.config_json, unit)

    def add_margin(self, key: str, margin: dict) -> None:
        self.add({"id": key, "margin": margin})


def run_ruler(config: RulerConfig, results_path: Path, cache_dir: Path, work_dir: Path,
              progress: Callable[[int], None] | None = None,
              log: Callable[[str], None] = print) -> tuple[list[dict], dict[str, dict]]:
    """Run every unit not yet in the store, then measure dense's margin on the samples they lost;
    returns all units in config.units() order and the margins by ruler_margin.margin_id."""
    from snapcompile.compiler.cache import ArtifactCache
    store = UnitStore(results_path, config)
    pending = [u for u in config.units() if unit_id(*u) not in store.units]
    if progress:
        progress(len(config.units()) - len(pending))
    cache = ArtifactCache(config.source, cache_dir, log)
    if pending:
        ruler.go_offline()
        ruler.offline_nltk(work_dir)
        folders = _artifacts(config, pending, cache)
        tasks = _TaskData(config, folders, work_dir)
        for folder, units in folders.items():
            _serve_and_run(config, folder, units, tasks, store, work_dir, progress, log)
    units = [store.units[unit_id(*u)] for u in config.units()]
    _measure_margins(config, units, store, cache, work_dir, log)
    return units, store.margins


def _measure_margins(config: RulerConfig, units: list[dict], store: UnitStore, cache, work_dir: Path, log) -> None:
    """Dense's margin on every lost sample not measured yet whose lm-eval logs are at hand, one
    dense engine per (weights, length)."""
    from snapcompile.engine.engine import Engine
    pending = [item for item in lost_samples(units) if margin_id(item) not in store.margins]
    for weights, length in sorted({(item["weights"], item["length"]) for item in pending}):
        mine = [item for item in pending if (item["weights"], item["length"]) == (weights, length)]
        cells = {"dense", *(item["cell"] for item in mine)}
        folders = {cell: _folder(config, cache, weights, cell, length) for cell in cells}
        logs = {cell: read_log(samples_path(config, work_dir, folders[cell].name, length)) for cell in cells}
        if not logs["dense"]:
            log(f"no lm-eval log of dense at {length} tokens ({weights}): its margins are not measured")
            continue
        log(f"dense's margin on {len(mine)} lost samples at {length} tokens ({weights})")
        engine = Engine.from_artifact(folders["dense"], session_cache_bytes=0)
        for key, margin in measure(engine, logs["dense"], mine, logs).items():
            store.add_margin(key, margin)


def samples_path(config: RulerConfig, work_dir: Path, artifact: str, length: int) -> Path:
    """lm-eval's per-sample log of one artifact at one length, in a folder of this configuration's
    own (another run on the same artifact writes its own), read back by the margins."""
    key = hashlib.sha256(json.dumps(asdict(config), sort_keys=True).encode()).hexdigest()[:12]
    return work_dir / "samples" / key / f"{artifact}-{length}.jsonl"


def _folder(config: RulerConfig, cache, weights: str, cell: str, length: int) -> Path:
    """Where the artifact of (weights, cell, length) is kept (ArtifactCache.folder_of)."""
    return cache.folder_of(config.export(weights), _policy(config, cell, length))


def _policy(config: RulerConfig, cell: str, length: int) -> PolicyConfig:
    policy, _ = parse_cell(cell)
    return policy_for(policy, budget_of(cell, length), config.scope, config.kernel)


def _artifacts(config: RulerConfig, pending, cache) -> dict[Path, list[tuple[str, str, int]]]:
    """The artifact of each pending unit (built or reused), grouped so each is served once."""
    folders: dict[Path, list] = {}
    for weights, cell, length in pending:
        folder = cache.get(config.export(weights), _policy(config, cell, length))
        folders.setdefault(folder, []).append((weights, cell, length))
    return folders


class _TaskData:
    """lm-eval tasks per length, made on first use with the tokenizer of the first artifact (all the
    artifacts of one source share it)."""

    def __init__(self, config: RulerConfig, folders: dict, work_dir: Path):
        self.config, self.tasks, self.log = config, {}, work_dir / "lm-eval.log"
        self.tokenizer = ruler.tokenizer_folder(next(iter(folders)), work_dir)

    def at(self, length: int) -> list:
        if length not in self.tasks:
            with lm_eval_output(self.log):
                self.tasks[length] = ruler.build_tasks(self.config.tasks, self.tokenizer, length)
        return self.tasks[length]


@contextlib.contextmanager
def lm_eval_output(path: Path):
    """lm-eval's prints and progress bars go to `path` (appended), not to this command's stdout
    (which `--json` keeps for one JSON line) or its progress bar."""
    with open(path, "a", encoding="utf-8") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        yield


def _serve_and_run(config, folder: Path, units, tasks: _TaskData, store: UnitStore, work_dir: Path,
                   progress, log) -> None:
    """Serve `folder` once and run its `units` against it."""
    from snapcompile.serve.process import ServerProcess
    log(f"serving {folder} for {', '.join(unit_id(*u) for u in units)}")
    server_log = work_dir / f"serve-{folder.name}.log"
    # samples never resume from each other (their figures stay those of a prompt prefilled whole)
    server = ServerProcess(folder, "--slots", str(config.slots), "--session-sharing", "private", model="ruler",
                           log=server_log)
    try:
        server.wait_ready(SERVER_START_S)
        for weights, cell, length in units:
            samples = _run_unit(config, server, tasks, folder.name, weights, length, work_dir)
            policy, ratio = parse_cell(cell)
            store.add({"id": unit_id(weights, cell, length), "weights": weights, "cell": cell, "policy": policy,
                       "ratio": ratio, "budget": budget_of(cell, length), "length": length, "samples": samples})
            if progress:
                progress(1)
    finally:
        server.stop()


def _run_unit(config, server, tasks: _TaskData, name: str, weights: str, length: int, work_dir: Path) -> list[dict]:
    """lm-eval at `length` against `server`; its failures (a request that failed, the server gone)
    become one error line naming the logs."""
    lm_eval_tasks = tasks.at(length)
    try:
        with lm_eval_output(tasks.log):
            return ruler.evaluate_served(lm_eval_tasks, server.url, "ruler", tasks.tokenizer, length,
                                         config.export(weights).max_context, config.limit, config.slots,
                                         work_dir / "lm-eval-cache" / f"{name}-{length}",
                                         samples_path(config, work_dir, name, length))
    except Exception as err:
        raise SnapcompileError(f"lm-eval failed at {length} tokens on {name}: {first_line(err)} (lm-eval's "
                               f"output: {tasks.log}; the server's: {server.log_path})") from None
