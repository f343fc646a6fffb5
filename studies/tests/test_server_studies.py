"""studies/store_lookup_bench.py and studies/event_loop_probe.py run and print their figures."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.study


def test_store_lookup_bench_runs_and_both_stores_agree():
    done = subprocess.run([sys.executable, "studies/store_lookup_bench.py", "--entries", "16", "--tokens", "300",
                           "--repeats", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("prefix index: ") and lines[1].startswith("every entry: ") and "ms a lookup" in lines[1]


def test_event_loop_probe_runs(tiny_snap_dir):
    done = subprocess.run([sys.executable, "studies/event_loop_probe.py", str(tiny_snap_dir), "--seconds", "2"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("/health: ") and " max " in done.stdout
