"""Two 1024-token prompts in one process on the 8B artifact, the peak (VmHWM, reset before each
prompt through /proc/self/clear_refs) and RssAnon after layer 31 and at each prompt's end (GiB):
whether the last step's rise comes back on every prompt or only on the first.

    .venv/bin/python docs/results/performance/2026-12-07-8b-32000/two_prompts.py /tmp/art/b8_32k
"""
import sys

import numpy as np

from snapcompile.runtime import open_backend


def rss() -> dict[str, float]:
    with open("/proc/self/status") as status:
        lines = [line.split() for line in status if line.startswith(("VmHWM", "RssAnon"))]
    return {words[0].rstrip(":"): round(int(words[1]) / 2**20, 2) for words in lines}


backend = open_backend(sys.argv[1])
for run in range(2):
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")                    # resets VmHWM to the current RSS
    prompt = np.random.default_rng(run).integers(0, backend.manifest.spec.vocab_size, 1024).tolist()
    seen = 0
    for _ in backend.prefill_chunks(0, prompt):
        if backend.prefills.layers_done > seen:
            seen = backend.prefills.layers_done
            if seen == backend.manifest.spec.num_layers - 1:
                print(run, "layer", seen, rss(), flush=True)
    print(run, "end", rss(), flush=True)
