#!/usr/bin/env bash
# Issue 54, session 37: the 1B int4 artifact with its KV cache in float32, float16 and int8, alternating,
# two rounds: one 4096-token prompt's prefill, then decode at 1 and 4 slots (32 steps), peak RSS.
# /tmp/art/b1        = convert random:llama-3.2-1b --weights int4 --slots 4 --max-context 8192 --budget 1024
# /tmp/art/b1-float16, /tmp/art/b1-int8: the same with --kv-dtype float16 / int8
set -u
cd /work/main
P=".venv/bin/python studies/artifact_point.py"
echo "== $(uptime)"
for r in 1 2; do
  for a in b1 b1-float16 b1-int8; do
    echo "== round $r $a"; $P /tmp/art/$a --context 4096 --slots 1,4 --steps 32 --repeats 1
  done
  echo "== $(uptime)"
done
