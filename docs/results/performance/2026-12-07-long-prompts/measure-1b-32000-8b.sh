#!/usr/bin/env bash
set -u
cd /work/main
# first, the same 1B 32000-token prompt on this commit: studies/artifact_point.py /tmp/art/b1_32k --context 32000 --slots 1 --steps 8 --repeats 1
echo "== uptime"; uptime
echo "== 1B 32000 OpenVINO"; (cd /work/peers && /usr/bin/time -f "maxrss_kb %M elapsed %e" ovenv/bin/python /work/shared/peers/ov_bench.py ov1b --context 32000 --batch 1 --new-tokens 8 --evict --max-cache 2048 | grep RESULT)
echo "== uptime"; uptime
echo "== 8B kv16 convert"; rm -rf /tmp/art/b8h; /usr/bin/time -f "maxrss_kb %M elapsed %e" .venv/bin/snapcompile convert random:llama-3.1-8b --weights int4 --block-size 128 --slots 8 --max-context 131072 --budget 2048 --kv-dtype float16 -o /tmp/art/b8h 2>&1 | grep -v "it/s\|%|" | tail -3
.venv/bin/snapcompile inspect /tmp/art/b8h | grep -i "memory\|KV"
echo "== uptime"; uptime
echo "== 8B kv16 131072 first layer"; /usr/bin/time -f "maxrss_kb %M elapsed %e" .venv/bin/python studies/first_layers.py /tmp/art/b8h --tokens 131072 --layers 1
echo "== uptime"; uptime
