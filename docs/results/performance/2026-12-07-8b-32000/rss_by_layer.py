"""RSS after opening an artifact and after each layer of one prompt's layer-by-layer prefill (GiB;
RssAnon is the process's own memory, RssFile the mapped weight files' resident pages, VmHWM the peak).

    .venv/bin/python docs/results/performance/2026-12-07-8b-32000/rss_by_layer.py /tmp/art/b8_32k 1024
"""
import sys

import numpy as np

from snapcompile.runtime import open_backend

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def rss() -> dict[str, float]:
    with open("/proc/self/status") as status:
        lines = [line.split() for line in status if line.startswith(FIELDS)]
    return {words[0].rstrip(":"): round(int(words[1]) / 2**20, 2) for words in lines}


print("start", rss(), flush=True)
backend = open_backend(sys.argv[1])
print("open", rss(), flush=True)
prompt = np.random.default_rng(0).integers(0, backend.manifest.spec.vocab_size, int(sys.argv[2])).tolist()
seen = 0
for _ in backend.prefill_chunks(0, prompt):
    if backend.prefills.layers_done > seen:
        seen = backend.prefills.layers_done
        print("layer", seen, rss(), flush=True)
print("end", rss(), flush=True)
