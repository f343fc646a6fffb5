#!/usr/bin/env bash
# One long prompt's prefill, snapcompile beside OpenVINO GenAI, alternating for $ROUNDS rounds in one
# sitting (issue 21's prefill target). Peer set-up: ../shared/peers/README.md (an OpenVINO venv and
# the optimum-intel exports). Prints our JSON lines (`snapcompile bench --measure prefill-schedules`) and the peer's
# `RESULT {json}` lines (prefill_s), then the load average.
#   OV_VENV=/path/ovenv OV_MODELS="/path/ov-int4" ARTIFACTS="art-fp32 art-int4" studies/prefill_peers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LENGTH=${LENGTH:-4096}
ROUNDS=${ROUNDS:-3}
OV_BENCH=${OV_BENCH:-../shared/peers/ov_bench.py}
: "${OV_VENV:?the OpenVINO GenAI venv}" "${OV_MODELS:?exported OpenVINO model folders}" "${ARTIFACTS:?snapcompile artifacts}"
for round in $(seq "$ROUNDS"); do
    echo "round $round"
    # shellcheck disable=SC2086
    for artifact in $ARTIFACTS; do
        .venv/bin/snapcompile bench "$artifact" --measure prefill-schedules --contexts "$LENGTH" --repeats 1 --json
    done
    for model in $OV_MODELS; do
        "$OV_VENV/bin/python" "$OV_BENCH" "$model" --context "$LENGTH" --batch 1 --new-tokens 4 --evict \
            --start 32 --recent 128 --max-cache 512 --snapkv-window 32 --label "$(basename "$model")" | grep RESULT
    done
done
uptime
