#!/usr/bin/env bash
# Issue 54's 8B target: one 32000-token prompt at the 8B shape (int4, blocks / groups of 128), ours
# (layer by layer, studies/first_layers.py over all 32 layers) beside OpenVINO GenAI 2026.4.1 on the
# same random weights (studies/random_folder.py -> optimum-cli), one after the other, machine quiet.
set -u
cd /work/main
T="/usr/bin/time -f maxrss_kb=%M,elapsed_s=%e"
echo "== uptime"; uptime
if [ ! -d /work/peers/ov8b_128 ]; then
  echo "== the random 8B folder"; $T .venv/bin/python studies/random_folder.py random:llama-3.1-8b /work/peers/hf8b --tokenizer /work/peers/hf1b
  echo "== OpenVINO's export"; $T /work/peers/ovenv/bin/optimum-cli export openvino --model /work/peers/hf8b --task text-generation-with-past \
      --weight-format int4 --sym --group-size 128 --ratio 1.0 /work/peers/ov8b_128 2>&1 | tail -3
  rm -rf /work/peers/hf8b
fi
if [ ! -d /tmp/art/b8_32k ]; then
  echo "== our convert"; $T .venv/bin/snapcompile convert random:llama-3.1-8b --weights int4 --block-size 128 --slots 1 \
      --max-context 32768 --budget 2048 -o /tmp/art/b8_32k 2>&1 | grep -v "it/s\|%|" | tail -2
fi
.venv/bin/snapcompile inspect /tmp/art/b8_32k | grep -i "memory\|KV"
echo "== uptime"; uptime
echo "== 8B 32000 OpenVINO"; (cd /work/peers && $T ovenv/bin/python /work/shared/peers/ov_bench.py ov8b_128 --context 32000 --batch 1 --new-tokens 8 --evict --max-cache 2048 | grep RESULT)
echo "== uptime"; uptime
echo "== 8B 32000 snapcompile"; $T .venv/bin/python studies/first_layers.py /tmp/art/b8_32k --tokens 32000 --layers 32
echo "== uptime"; uptime
