#!/usr/bin/env bash
# The serving measurements of docs/results/performance.md, SmolLM2-135M-Instruct, 8-slot artifacts:
# 32 requests of ~2000 prompt tokens and 128 output tokens each (prompts from bench-serve's seed 0),
#  1. through `snapcompile serve` (snapstream B=512 and dense), driven by `bench-serve` at
#     concurrency 1 and 8, and the same prompts through `snapcompile run` (no HTTP);
#  2. through Triton Inference Server (snapstream: 1 instance; 2 instances with all cores each;
#     2 instances with one ONNX Runtime thread each), at concurrency 8.
# Writes $OUT/*.json and *.md. About an hour on 2 cores (prefill dominates). PARTS=serve or
# PARTS=triton runs one part.
set -euo pipefail
cd "$(dirname "$0")/.."
SNAP=.venv/bin/snapcompile
OUT=${OUT:-docs/results/serving}
ART=${ART:-artifacts}
PORT=${PORT:-18631}
PARTS=${PARTS:-serve triton}
BENCH=(--requests 32 --prompt-tokens 2000 --output-tokens 128 --seed 0 --force)   # one seed: the same prompts for every (fresh) server
mkdir -p "$OUT" "$ART"
[ -f "$ART/smollm2-snap512-n8/manifest.json" ] || $SNAP convert smollm2-135m-instruct -o "$ART/smollm2-snap512-n8" \
    --slots 8 --budget 512 --max-context 2304
[ -f "$ART/smollm2-dense-n8/manifest.json" ] || $SNAP export smollm2-135m-instruct -o "$ART/smollm2-dense-n8" \
    --slots 8 --max-context 2304

wait_for() { until curl -sf "$1" >/dev/null; do sleep 1; done; }

if [[ " $PARTS " == *" serve "* ]]; then
    for name in snap dense; do
        artifact=$ART/smollm2-$([ $name = snap ] && echo snap512 || echo dense)-n8
        $SNAP serve "$artifact" --port "$PORT" --served-model-name smollm2 --log-level warning &
        server=$!
        wait_for "http://127.0.0.1:$PORT/health"
        for concurrency in 1 8; do
            $SNAP bench-serve "http://127.0.0.1:$PORT" --model smollm2 --concurrency $concurrency "${BENCH[@]}" \
                --tokenizer "$artifact" --save-prompts "$OUT/prompts.jsonl" -o "$OUT/$name-c$concurrency.json"
        done
        kill -TERM $server && wait $server
        $SNAP run "$artifact" --prompts "$OUT/prompts.jsonl" --raw --ignore-eos --max-new-tokens 128 --json \
            -o "$OUT/$name-run.jsonl" --force \
            | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["summary"]))' > "$OUT/$name-run.summary.json"
    done
fi

if [[ " $PARTS " == *" triton "* ]]; then
    artifact=$ART/smollm2-snap512-n8
    for setting in 1 2 2:1; do                          # instances[:threads per instance]
        instances=${setting%%:*}
        threads=$([[ $setting == *:* ]] && echo "--threads ${setting##*:}" || true)
        name=triton-i$instances$([[ $setting == *:* ]] && echo "-threads${setting##*:}" || true)
        repo=$ART/$name
        $SNAP triton-repo "$artifact" -o "$repo" --model-name smollm2 --instances "$instances" $threads --link --force
        $SNAP triton-serve "$repo" --http-port "$PORT" --grpc-port $((PORT + 1)) --metrics-port $((PORT + 2)) \
            > "$OUT/$name.log" 2>&1 &
        server=$!
        wait_for "http://127.0.0.1:$PORT/v2/health/ready"
        $SNAP bench-serve "http://127.0.0.1:$PORT" --api triton --model smollm2 --concurrency 8 "${BENCH[@]}" \
            --tokenizer "$artifact" -o "$OUT/$name-c8.json"
        kill -TERM $server && wait $server
    done
fi
