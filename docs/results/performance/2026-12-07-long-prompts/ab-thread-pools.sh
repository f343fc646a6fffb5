#!/usr/bin/env bash
# per-session thread pools (f12d6af, /tmp/pre) vs one shared pool (HEAD), same artifact, alternating
cd /work/main
for r in 1 2; do
  for order in chunks layers; do
    echo "== shared $order $r"; .venv/bin/python studies/artifact_point.py /tmp/art/b1n --context 2048 --slots 1 --steps 16 --repeats 1 --prefill-order $order
    echo "== per-session $order $r"; (cd /tmp/pre && PYTHONPATH=/tmp/pre /work/main/.venv/bin/python studies/artifact_point.py /tmp/art/b1n --context 2048 --slots 1 --steps 16 --repeats 1 --prefill-order $order)
  done
done
uptime
