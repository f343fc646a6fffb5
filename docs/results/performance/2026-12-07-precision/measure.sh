#!/usr/bin/env bash
# Issue 54, session 36: the 1B int4 4096-token prefill beside OpenVINO GenAI at its default precision
# (bf16 on this CPU) and with INFERENCE_PRECISION_HINT f32 (float32 arithmetic, as ours), alternating,
# two rounds. /tmp/art/b1 = convert random:llama-3.2-1b --weights int4 --slots 4 --max-context 8192 --budget 1024
set -u
cd /work/main
P=".venv/bin/python studies/artifact_point.py"
OV="/work/peers/ovenv/bin/python /work/shared/peers/ov_bench.py /work/peers/ov1b --context 4096 --batch 1 --new-tokens 8 --evict --max-cache 1024"
echo "== uptime"; uptime
for r in 1 2; do
  echo "== snapcompile round $r"; $P /tmp/art/b1 --context 4096 --slots 1 --steps 8 --repeats 1
  echo "== OpenVINO default round $r"; $OV | grep RESULT
  echo "== OpenVINO f32 round $r"; $OV --hint f32 | grep RESULT
  echo "== uptime"; uptime
done
