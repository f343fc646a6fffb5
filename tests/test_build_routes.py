"""One build route: `convert`, the measuring tools' ArtifactCache, `export` + `compress`, and the test
fixtures give byte-identical artifacts for the same inputs, the same as before the refactor that made
them one (tests/data/golden_artifacts.json, written by `PYTHONPATH=. python tests/test_build_routes.py` at
0ece7a6; its manifest hashes again at 4e3faa6, whose weights report added gguf_tensors_requantized and
nothing else; at format 6, whose manifest lists the graphs ONNX Runtime opens, written beside the
static ones, whose files kept their hashes; at format 8, whose ONNX Runtime prefill graphs read each KV head by
Gather: those files' hashes changed, no other file's), and the measuring tools default
to the shapes `convert` writes."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from snapcompile.artifact.manifest import MANIFEST
from snapcompile.config import ExportConfig, PolicyConfig
from tests.cli_helpers import invoke

GOLDEN = Path(__file__).parent / "data" / "golden_artifacts.json"
CASES = {   # name -> convert's arguments after the model and -o
    "snapstream": ["--max-context", "512", "--budget", "128", "--slots", "2"],
    "int4-summaries": ["--max-context", "512", "--budget", "128", "--weights", "int4", "--summaries", "4"],
}


def fingerprint(folder: Path) -> dict:
    """What must not change: every file's sha256 (the manifest lists them) and the manifest itself,
    less the library versions it records."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest.pop("versions")
    canonical = json.dumps(manifest, sort_keys=True).encode()
    return {"files": {name: entry["sha256"] for name, entry in manifest["files"].items()},
            "manifest": hashlib.sha256(canonical).hexdigest()}


def test_convert_writes_the_artifacts_it_wrote_before(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    for name, args in CASES.items():
        assert invoke("convert", "tiny-llama", "-o", tmp_path / name, *args).exit_code == 0
        assert fingerprint(tmp_path / name) == golden[name], name


def test_convert_the_cache_and_export_plus_compress_give_the_same_bytes(tmp_path):
    from snapcompile.compiler.cache import ArtifactCache
    export = ExportConfig(slots=2, max_context=512, chunk=64)
    policy = PolicyConfig(budget=128)
    assert invoke("convert", "tiny-llama", "-o", tmp_path / "convert", *CASES["snapstream"]).exit_code == 0
    cached = ArtifactCache("tiny-llama", tmp_path / "cache", log=lambda message: None).get(export, policy)
    assert invoke("export", "tiny-llama", "-o", tmp_path / "dense", "--max-context", 512, "--slots", 2).exit_code == 0
    assert invoke("compress", tmp_path / "dense", "-o", tmp_path / "compressed", "--budget", 128).exit_code == 0
    expected = fingerprint(tmp_path / "convert")
    assert fingerprint(cached) == expected
    assert fingerprint(tmp_path / "compressed") == expected


def test_the_measuring_tools_default_to_the_shapes_convert_writes():
    from snapcompile.bench.runner import BenchConfig
    from snapcompile.bench.turn_latency import TurnsBenchConfig
    from snapcompile.evaluation.config import EvalConfig
    from snapcompile.evaluation.conversation_eval import TurnsConfig
    from snapcompile.evaluation.ruler_run import RulerConfig
    product = ExportConfig()
    for config in (BenchConfig, TurnsBenchConfig, EvalConfig, RulerConfig, TurnsConfig):
        assert config.__dataclass_fields__["chunk"].default == product.chunk, config.__name__
    passkey = EvalConfig("tiny-llama", "passkey", ("dense",), (), (256,), (0.5,), 1, 0)
    assert (passkey.export.chunk, passkey.export.tail) == (product.chunk, product.tail)
    assert RulerConfig("tiny-llama").export("fp32").tail == product.tail


def write_golden(out: Path) -> None:
    """Run as a script (with the code whose artifacts are the reference): write the golden file."""
    import tempfile
    golden = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in CASES.items():
            assert invoke("convert", "tiny-llama", "-o", Path(tmp) / name, *args).exit_code == 0
            golden[name] = fingerprint(Path(tmp) / name)
    out.write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    write_golden(Path(sys.argv[1]) if len(sys.argv) > 1 else GOLDEN)
elif not GOLDEN.is_file():
    pytest.fail(f"{GOLDEN} is missing", pytrace=False)


def test_compile_reports_each_dense_graph_as_it_is_built(tmp_path):
    from snapcompile.artifact.naming import expected_graphs, ort_graphs
    from snapcompile.compiler.route import compile_artifact
    from snapcompile.export.dense import ORT_LABEL
    export, built, totals = ExportConfig(slots=2, max_context=512, chunk=64), [], set()
    manifest = compile_artifact("tiny-llama", export, PolicyConfig(budget=128), tmp_path / "a",
                                progress=lambda name, total: (built.append(name), totals.add(total)))
    dense = PolicyConfig(policy="dense")
    ort = [name.removeprefix(ORT_LABEL) for name in built if name.startswith(ORT_LABEL)]
    assert sorted(set(built) - {ORT_LABEL + name for name in ort}) == sorted(expected_graphs(export, dense))
    assert sorted(ort) == sorted(ort_graphs(export, dense, "standard", manifest.spec.num_layers))
    assert totals == {len(built)}
    assert set(built) - {ORT_LABEL + name for name in ort} < set(manifest.graphs)   # select comes from the passes
    assert set(ort) < set(manifest.ort_graphs)
