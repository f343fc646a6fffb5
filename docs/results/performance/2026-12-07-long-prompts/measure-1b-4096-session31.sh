#!/usr/bin/env bash
# Issue 54: 1B int4 4096-token prefill, layer by layer (new), chunk by chunk (new code), the session's starting code, OpenVINO GenAI
set -u
cd /work/main
echo "== uptime"; uptime
for r in 1 2; do
  echo "== 1B new layers round $r"; .venv/bin/python studies/artifact_point.py /tmp/art/b1n --context 4096 --slots 1,4 --steps 16 --repeats 1
  echo "== 1B OpenVINO round $r"; (cd /work/peers && ovenv/bin/python /work/shared/peers/ov_bench.py ov1b --context 4096 --batch 1 --new-tokens 8 --evict --max-cache 1024 | grep RESULT)
  echo "== 1B old round $r"; (cd /tmp/old && PYTHONPATH=/tmp/old /work/main/.venv/bin/python studies/artifact_point.py /tmp/art/b1-old --context 4096 --slots 1,4 --steps 16 --repeats 1)
  echo "== 1B new chunks round $r"; .venv/bin/python studies/artifact_point.py /tmp/art/b1n --context 4096 --slots 1 --steps 16 --repeats 1 --prefill-order chunks
done
echo "== uptime"; uptime
