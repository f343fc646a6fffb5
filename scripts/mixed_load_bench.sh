#!/usr/bin/env bash
# Serving under mixed load (issue 21), SmolLM2-135M-Instruct int4, 8-slot artifacts, one sitting:
# snapstream B=512 with --chunk 256 (the old default) and --chunk 64, and dense with --chunk 64, each
# through `snapcompile serve` driven by `bench-serve`: concurrency 8 (32 x 2000 + 128 tokens) and
# concurrency 1 (4 requests). One fresh seed per sitting, the same prompts for every system.
# Writes $OUT/<system>-c<concurrency>.json. About 20 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
SNAP=.venv/bin/snapcompile
OUT=${OUT:-docs/results/mixed-load}
ART=${ART:-artifacts}
PORT=${PORT:-18632}
SEED=${SEED:-$RANDOM}
SYSTEMS=${SYSTEMS:-snap-c256 snap-c64 dense-c64}
mkdir -p "$OUT" "$ART"
convert() {   # name, extra convert arguments
    [ -f "$ART/mixed-$1/manifest.json" ] || $SNAP convert smollm2-135m-instruct -o "$ART/mixed-$1" --slots 8 \
        --max-context 2304 --weights int4 "${@:2}"
}
convert snap-c256 --chunk 256
convert snap-c64 --chunk 64
convert dense-c64 --chunk 64 --policy dense
wait_for() { until curl -sf "$1" >/dev/null; do sleep 1; done; }
for name in $SYSTEMS; do
    $SNAP serve "$ART/mixed-$name" --port "$PORT" --served-model-name smollm2 --log-level warning &
    server=$!
    wait_for "http://127.0.0.1:$PORT/health"
    $SNAP bench-serve "http://127.0.0.1:$PORT" --model smollm2 --concurrency 8 --requests 32 --prompt-tokens 2000 \
        --output-tokens 128 --seed "$SEED" --tokenizer "$ART/mixed-$name" -o "$OUT/$name-c8.json" --force
    $SNAP bench-serve "http://127.0.0.1:$PORT" --model smollm2 --concurrency 1 --requests 4 --prompt-tokens 2000 \
        --output-tokens 128 --seed "$SEED" --tokenizer "$ART/mixed-$name" -o "$OUT/$name-c1.json" --force
    kill -TERM $server && wait $server
done
echo "seed $SEED; $(uptime)"
