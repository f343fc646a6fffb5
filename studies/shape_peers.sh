#!/usr/bin/env bash
# One artifact's prefill and decode beside OpenVINO GenAI on the same random weights, alternating for
# $ROUNDS rounds in one sitting (issue 41's 1B and 8B points). Peer set-up: ../shared/peers/README.md;
# the OpenVINO model is optimum-cli's export of `studies/random_folder.py SHAPE FOLDER`. Prints our
# JSON line (studies/artifact_point.py: prefill_s, decode tok/s per slot count, peak RSS) and the peer's
# `RESULT {json}` line per batch (batch 1's prefill_s is one prompt's prefill), then the load average.
#   OV_VENV=../peers/ovenv OV_MODEL=../peers/ov1b ARTIFACT=/tmp/b1 SLOTS="1 4" BUDGET=1024 studies/shape_peers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CONTEXT=${CONTEXT:-4096}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-32}
OV_BENCH=${OV_BENCH:-../shared/peers/ov_bench.py}
: "${OV_VENV:?the OpenVINO GenAI venv}" "${OV_MODEL:?the exported OpenVINO model folder}" \
  "${ARTIFACT:?the snapcompile artifact}" "${SLOTS:?slot counts, e.g. 1 4}" "${BUDGET:?the budget B of the artifact}"
for round in $(seq "$ROUNDS"); do
    echo "round $round $(cut -d' ' -f1-3 /proc/loadavg)"
    .venv/bin/python studies/artifact_point.py "$ARTIFACT" --context "$CONTEXT" --slots "${SLOTS// /,}" \
        --steps "$STEPS" --repeats 1
    for batch in $SLOTS; do
        "$OV_VENV/bin/python" "$OV_BENCH" "$OV_MODEL" --context "$CONTEXT" --batch "$batch" --new-tokens "$STEPS" \
            --evict --start 32 --recent 128 --max-cache "$BUDGET" --snapkv-window 32 --label "batch $batch" | grep RESULT
    done
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
