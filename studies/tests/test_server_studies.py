"""studies/store_lookup_bench.py, event_loop_probe.py and serve_memory.py run and print their figures."""
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.study


@pytest.mark.parametrize("scenario", [[], ["--system", "190", "--new"], ["--system", "190", "--new",
                                                                           "--compressed-at", "250"]])
def test_store_lookup_bench_runs_and_both_stores_agree(scenario):
    done = subprocess.run([sys.executable, "studies/store_lookup_bench.py", "--entries", "16", "--tokens", "300",
                           "--repeats", "2", *scenario], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("prefix index: ") and lines[1].startswith("every entry: ") and "ms a lookup" in lines[1]


def test_event_loop_probe_runs(tiny_snap_dir):
    done = subprocess.run([sys.executable, "studies/event_loop_probe.py", str(tiny_snap_dir), "--seconds", "2"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("/health: ") and " max " in done.stdout


def test_serve_memory_measures_serve_alone(tiny_snap_dir):
    done = subprocess.run([sys.executable, "studies/serve_memory.py", str(tiny_snap_dir), "--rounds", "1",
                           "--requests", "2", "--prompt-tokens", "50"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    line, ready, after = done.stdout.splitlines()[-3:]
    assert line.startswith("snapcompile serve: ready ") and "(5 processes)" in line and "failed requests: 0" in line
    for parts in (ready, after):
        assert re.fullmatch(r"  MiB (ready|after): cli \d+, tokenizer_worker \d+, tokenizer_worker \d+, "
                            r"body_worker \d+, body_worker \d+", parts), parts
