#!/usr/bin/env bash
# Issue 54, quiet sitting after the shared thread pool was reverted: this commit beside the session's start (6c25b46, /tmp/old)
set -u
cd /work/main
P=".venv/bin/python studies/artifact_point.py"
OLD="env PYTHONPATH=/tmp/old /work/main/.venv/bin/python studies/artifact_point.py"
echo "== uptime"; uptime
for r in 1 2; do
  echo "== 1B layers round $r"; $P /tmp/art/b1n --context 4096 --slots 1,4 --steps 16 --repeats 1
  echo "== 1B old round $r"; (cd /tmp/old && $OLD /tmp/art/b1-old --context 4096 --slots 1,4 --steps 16 --repeats 1)
  echo "== 1B float16 cache round $r"; $P /tmp/art/b1h --context 4096 --slots 1,4 --steps 16 --repeats 1
  echo "== 1B 256 layers round $r"; $P /tmp/art/b1n --context 256 --slots 1 --steps 4 --repeats 3
  echo "== 1B 256 old round $r"; (cd /tmp/old && $OLD /tmp/art/b1-old --context 256 --slots 1 --steps 4 --repeats 3)
  echo "== SmolLM2 layers round $r"; $P /tmp/art/sm4 --context 4096 --slots 1 --steps 16 --repeats 1
  echo "== SmolLM2 old round $r"; (cd /tmp/old && $OLD /tmp/art/sm4-old --context 4096 --slots 1 --steps 16 --repeats 1)
  echo "== uptime"; uptime
done
