"""studies/store_lookup_bench.py: both stores find the resumed conversation; it prints both timings."""
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
