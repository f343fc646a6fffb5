#!/usr/bin/env bash
# The serving measurement of docs/results/performance.md: SmolLM2-135M-Instruct, snapstream B=512 and
# dense artifacts of 8 slots; 32 requests of ~2000 prompt tokens and 128 output tokens each, through
# `snapcompile serve` driven by `snapcompile bench-serve` at concurrency 1 and 8, and the same prompts
# through `snapcompile run` (no HTTP) for comparison. Writes $OUT/{snap,dense}-c{1,8}.{json,md} and
# $OUT/{snap,dense}-run.jsonl + .summary.json. About 45 minutes on 2 cores (prefill dominates).
set -euo pipefail
cd "$(dirname "$0")/.."
SNAP=.venv/bin/snapcompile
OUT=${OUT:-docs/results/serving}
ART=${ART:-artifacts}
PORT=${PORT:-18631}
mkdir -p "$OUT" "$ART"
[ -f "$ART/smollm2-snap512-n8/manifest.json" ] || $SNAP convert smollm2-135m-instruct -o "$ART/smollm2-snap512-n8" \
    --slots 8 --budget 512 --max-context 2304
[ -f "$ART/smollm2-dense-n8/manifest.json" ] || $SNAP export smollm2-135m-instruct -o "$ART/smollm2-dense-n8" \
    --slots 8 --max-context 2304
for name in snap dense; do
    artifact=$ART/smollm2-$([ $name = snap ] && echo snap512 || echo dense)-n8
    $SNAP serve "$artifact" --port "$PORT" --served-model-name smollm2 --log-level warning &
    server=$!
    until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 1; done
    for concurrency in 1 8; do
        $SNAP bench-serve "http://127.0.0.1:$PORT" --model smollm2 --requests 32 --concurrency $concurrency \
            --prompt-tokens 2000 --output-tokens 128 --tokenizer "$artifact" \
            --save-prompts "$OUT/prompts.jsonl" --force -o "$OUT/$name-c$concurrency.json"
    done
    kill -TERM $server && wait $server
    $SNAP run "$artifact" --prompts "$OUT/prompts.jsonl" --raw --ignore-eos --max-new-tokens 128 --json \
        -o "$OUT/$name-run.jsonl" --force | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["summary"]))' \
        > "$OUT/$name-run.summary.json"
done
