#!/usr/bin/env bash
# One artifact's prefill and decode beside OpenVINO GenAI on the same random weights, alternating for
# $ROUNDS rounds in one sitting (issue 41's 1B and 8B points). Peer set-up: ../shared/peers/README.md;
# the OpenVINO model is optimum-cli's export of `studies/random_folder.py SHAPE FOLDER`. Prints our
# JSON line (studies/artifact_point.py: prefill_s, decode tok/s per slot count, peak RSS) and the peer's
# `RESULT {json}` line per batch (batch 1's prefill_s is one prompt's prefill), then the load average.
#   OV_VENV=../peers/ovenv OV_MODEL=../peers/ov1b ARTIFACT=/tmp/b1 SLOTS="1 4" BUDGET=1024 studies/shape_peers.sh
# With LLAMA_BATCHED_BENCH (llama.cpp's llama-batched-bench, built as ../shared/peers/README.md says) and
# LLAMA_GGUF (convert_hf_to_gguf.py of the same folder, llama-quantize Q4_0: 4-bit blocks of 32), each
# round also runs llama.cpp: one JSON line per slot count (t_pp: the prefill of that many prompts at
# once; speed_tg: decode tok/s of all of them) and its peak RSS. llama.cpp keeps every token's KV: no
# eviction, so its cache grows with the context where ours and OpenVINO's stop at the budget.
set -euo pipefail
cd "$(dirname "$0")/.."
CONTEXT=${CONTEXT:-4096}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-32}
OV_BENCH=${OV_BENCH:-../shared/peers/ov_bench.py}
: "${OV_VENV:?the OpenVINO GenAI venv}" "${OV_MODEL:?the exported OpenVINO model folder}" \
  "${ARTIFACT:?the snapcompile artifact}" "${SLOTS:?slot counts, e.g. 1 4}" "${BUDGET:?the budget B of the artifact}"
if [[ -n "${LLAMA_BATCHED_BENCH:-}" ]]; then
    : "${LLAMA_GGUF:?the Q4_0 GGUF llama-batched-bench reads}"
    most=$(tr ' ' '\n' <<<"$SLOTS" | sort -n | tail -1)   # its context holds every sequence's tokens
fi
for round in $(seq "$ROUNDS"); do
    echo "round $round $(cut -d' ' -f1-3 /proc/loadavg)"
    .venv/bin/python studies/artifact_point.py "$ARTIFACT" --context "$CONTEXT" --slots "${SLOTS// /,}" \
        --steps "$STEPS" --repeats 1
    for batch in $SLOTS; do
        "$OV_VENV/bin/python" "$OV_BENCH" "$OV_MODEL" --context "$CONTEXT" --batch "$batch" --new-tokens "$STEPS" \
            --evict --start 32 --recent 128 --max-cache "$BUDGET" --snapkv-window 32 --label "batch $batch" | grep RESULT
    done
    if [[ -n "${LLAMA_BATCHED_BENCH:-}" ]]; then
        /usr/bin/time -f "llama.cpp peak RSS %M KiB" "$LLAMA_BATCHED_BENCH" -m "$LLAMA_GGUF" \
            -c $((most * (CONTEXT + STEPS))) -npp "$CONTEXT" -ntg "$STEPS" -npl "${SLOTS// /,}" -t 2 -tb 2 \
            --output-format jsonl 2>&1 | grep -E '^\{|peak RSS'
    fi
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
