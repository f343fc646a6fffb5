#!/usr/bin/env bash
# Issue 54, quiet sitting: 1B int4 4096 and 256-token prompts, SmolLM2 int4 4096, this commit (layers, chunks, float16 cache)
# beside the session's starting code (6c25b46, /tmp/old) and OpenVINO GenAI, alternating, two rounds
set -u
cd /work/main
# (waited for the 8B measurement to end)
P=".venv/bin/python studies/artifact_point.py"
OLD="env PYTHONPATH=/tmp/old /work/main/.venv/bin/python studies/artifact_point.py"
echo "== uptime"; uptime
for r in 1 2; do
  echo "== 1B layers round $r"; $P /tmp/art/b1n --context 4096 --slots 1,4 --steps 16 --repeats 1
  echo "== 1B OpenVINO round $r"; (cd /work/peers && ovenv/bin/python /work/shared/peers/ov_bench.py ov1b --context 4096 --batch 1 --new-tokens 8 --evict --max-cache 1024 | grep RESULT)
  echo "== 1B old round $r"; (cd /tmp/old && $OLD /tmp/art/b1-old --context 4096 --slots 1,4 --steps 16 --repeats 1)
  echo "== 1B chunks round $r"; $P /tmp/art/b1n --context 4096 --slots 1 --steps 16 --repeats 1 --prefill-order chunks
  echo "== 1B float16 cache round $r"; $P /tmp/art/b1h --context 4096 --slots 1,4 --steps 16 --repeats 1
  echo "== 1B 256 layers round $r"; $P /tmp/art/b1n --context 256 --slots 1 --steps 4 --repeats 3
  echo "== 1B 256 old round $r"; (cd /tmp/old && $OLD /tmp/art/b1-old --context 256 --slots 1 --steps 4 --repeats 3)
  echo "== SmolLM2 layers round $r"; $P /tmp/art/sm4 --context 4096 --slots 1 --steps 16 --repeats 1
  echo "== SmolLM2 OpenVINO round $r"; (cd /work/peers && ovenv/bin/python /work/shared/peers/ov_bench.py ovsm-int4 --context 4096 --batch 1 --new-tokens 8 --evict --max-cache 512 | grep RESULT)
  echo "== SmolLM2 old round $r"; (cd /tmp/old && $OLD /tmp/art/sm4-old --context 4096 --slots 1 --steps 16 --repeats 1)
  echo "== uptime"; uptime
done
