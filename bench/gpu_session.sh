#!/usr/bin/env bash
# Every GPU figure of one session, in one device call (see ../shared/gpu/README.md for the set-up):
#   source .gpu/b/install.sh && bash bench/gpu_session.sh STEP...    (KIT: where install.sh and floor.py are, default .gpu/b)
# Steps: floor, floor32k (the same at 32,000 tokens), hits (bench/probes/first_hit_probe.py at 4,000 and 32,000 tokens:
# in process and through the daemon), batch, batchstep (bench/probes/batch_step_probe.py), probe, firsthit (bench/probes/first_hit_probe.py), probe-ragged (its part 4: a left-padded decode
# batch), probe-conv (bench/probes/conv_shape_probe.py: lfm2's short convolution at new tail lengths), probe-decode
# (bench/probes/decode_batch_probe.py: the daemon's decode batch step by step as the shared workload's rounds fill and
# empty it; probe-decode-nographs: the same with MLX_USE_CUDA_GRAPHS=0), probe-chat (bench/probes/chat_turn_probe.py: a warm
# chat turn's prefill, operation by operation), quick, full, chunk512, concurrency, lfm2-quick, lfm2-full; and
# quick-fused, full-fused, lfm2-quick-fused: the same with --attention fused (MLX's own attention for
# tails, to compare with the default matmul form on CUDA: models/tail_attention.py); probe-tails
# (shape_probe parts 6-7), probe-tails-nographs (part 7 with MLX_USE_CUDA_GRAPHS=0), fuse
# (bench/probes/cuda_cache_fuse.py: MLX's cache-thrashing fuse and the daemon's setting); quick-nographs,
# full-nographs: every system with MLX_USE_CUDA_GRAPHS=0; agent, agent-quick, lfm2-agent (bench/agent_workload.py:
# 4 agents x 8 turns on an ~8,000-token tool-laden system prompt, prefixd vs mlx-lm server; quick: 2 x 4 on 1,500);
# fairness, lfm2-fairness (bench/fairness.py --quick; fairness and fairness-full, the full form, write the engine's
# step trace beside their figures: PREFIXD_TRACE_STEPS); shared-probe (bench/probes/shared_prefix_probe.py: attention over stored
# pieces read in place against the fused call and today's fork copy), quick-share (compare.py --quick with --fork share); quick-alt (compare.py --quick on the prefixd in $ALT_TREE), concurrency-alt (bench/concurrency.py --quick on it); hits-raw (hits' daemon part only), hits-raw-nographs (the same with MLX_USE_CUDA_GRAPHS=0), hits-raw-alt (the same on $ALT_TREE); rowlinear
# (bench/probes/row_linear_probe.py: a few rows through the linear layers as one matmul or one matrix-vector product per
# row), concurrency-full (concurrency.py's full form: 1, 2, 4 and 8 sessions), concurrency-full-linear-rows,
# concurrency-full-linear-matmul, quick-linear-rows and quick-linear-matmul (those with --linear rows or matmul);
# profile (bench/probes/daemon_profile.py: the daemon's step trace and a py-spy profile with 1, 4 and 8 sessions; lfm2-profile: one lfm2 session;
# py-spy's wheel goes into .gpu/b/wheels), rowlinear-steps (row_linear_probe's in-process decode steps alone);
# padded (bench/probes/padded_decode_probe.py: a padded decode batch's attention, MLX's masked form against
# prefixd's kernel), concurrency-attn-kernel / -matmul (concurrency.py with 200 tokens a session and --attention
# kernel or matmul), concurrency-full-attn-kernel / -matmul (its full form, 48 tokens), profile-attn-matmul;
# padded-long (padded_decode_probe.py: one call at 1,000, 8,000 and 32,000 keys with every key-range count, and
# BatchGenerator's step 8,000 tokens deep), padded-solo (its part solo: a sequence decoding alone 1,000-32,000 deep), concurrency-deep-attn-kernel / -matmul (concurrency.py, 200 tokens a
# session, each 8,000 tokens deep), concurrency-deep-alt (the same, default attention, on $ALT_TREE);
# join-crowd (join_probe.py --crowd 8: a join and a leave against a running batch's steady steps, 1,000 and
# 8,000 deep), front-cost (front_cost.py: the event loop's CPU per streamed lfm2 token, and decode streamed
# against whole replies); ragged-probe (bench/probes/ragged_step_probe.py: a decode step padded against ragged,
# rows of equal and of mixed depths), concurrency-ragged / concurrency-deep-ragged (concurrency-attn-kernel's and
# concurrency-deep-attn-kernel's runs with --batch-step ragged).
# Each step runs under what is left of BUDGET_S (default 560 s, inside the 600 s call limit) and logs
# into $OUT/raw/; at the end everything is packed into $OUT/gpu_results.tgz (the device returns at
# most 8 files), with the tree's commit when the caller wrote it to COMMIT in the tree's root.
set -uo pipefail
out=${OUT:?run on the device: OUT is where results go}/raw
mkdir -p "$out"
budget=${BUDGET_S:-560}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,temperature.gpu --format=csv > "$out/nvidia-smi.txt" 2>&1
[ -f COMMIT ] && cp COMMIT "$out/"

step() {  # step NAME COMMAND...: run it under the time left, log to $out/NAME.log
  local name=$1; shift
  local left=$((budget - SECONDS))
  if [ "$left" -lt 30 ]; then echo "== $name: skipped, ${left}s left" | tee -a "$out/skipped.txt"; return; fi
  echo "== $name (${left}s left)"
  local started=$SECONDS
  timeout -s INT "$left" "$@" > "$out/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - started))s" | tee -a "$out/steps.txt"
  tail -n 25 "$out/$name.log"
}

alt_prefixd() {  # /tmp/pfx-alt/prefixd: the package of the tree in $ALT_TREE (a folder with its daemon/ client/ protocol/)
  mkdir -p /tmp/pfx-alt/prefixd
  for p in daemon client protocol; do ln -sfn "$(cd "${ALT_TREE:?}" && pwd)/$p" /tmp/pfx-alt/prefixd/$p; done
}

for s in "$@"; do
  case $s in
    floor) step floor python3 "${KIT:-.gpu/b}"/floor.py /tmp/q06 4000 ;;
    floor32k) step floor32k python3 "${KIT:-.gpu/b}"/floor.py /tmp/q06 32000 ;;
    hits) step hits python3 bench/probes/first_hit_probe.py /tmp/q06 --parts 1,2 --lengths 4000,32000 --json "$out/hits.json" ;;
    hits-raw) step hits-raw python3 bench/probes/first_hit_probe.py /tmp/q06 --parts 2 --lengths 4000,32000 --json "$out/hits-raw.json" ;;
    hits-raw-nographs) MLX_USE_CUDA_GRAPHS=0 step hits-raw-nographs python3 bench/probes/first_hit_probe.py /tmp/q06 --parts 2 --lengths 4000,32000 --json "$out/hits-raw-nographs.json" ;;
    hits-raw-alt)  # the same on the prefixd in $ALT_TREE
      alt_prefixd
      PYTHONPATH=/tmp/pfx-alt:${PYTHONPATH#/tmp/pfx:} step hits-raw-alt python3 bench/probes/first_hit_probe.py /tmp/q06 --parts 2 --lengths 4000,32000 --json "$out/hits-raw-alt.json" ;;
    batch) step batch python3 bench/probes/batch_probe.py /tmp/q06 --context 1000 --steps 48 ;;
    padded) step padded python3 bench/probes/padded_decode_probe.py /tmp/q06 --context 1000 --steps 40 ;;
    padded-long) step padded-long python3 bench/probes/padded_decode_probe.py /tmp/q06 --call-contexts 1000,8000,32000 --context 8000 --steps 30 --parts call,batch ;;
    padded-solo) step padded-solo python3 bench/probes/padded_decode_probe.py /tmp/q06 --steps 30 --parts solo ;;
    concurrency-deep-attn-kernel|concurrency-deep-attn-matmul)  # a coding agent's depth: 8,000 tokens a session
      PREFIXD_ATTENTION=${s#concurrency-deep-attn-} step "$s" python3 bench/concurrency.py --smollm2 /tmp/q06 --tokens 200 --depth 8000 --json "$out/$s.json" ;;
    concurrency-attn-kernel|concurrency-attn-matmul)  # steady batches: 200 tokens a session
      PREFIXD_ATTENTION=${s#concurrency-attn-} step "$s" python3 bench/concurrency.py --smollm2 /tmp/q06 --tokens 200 --json "$out/$s.json" ;;
    concurrency-full-attn-kernel|concurrency-full-attn-matmul)
      PREFIXD_ATTENTION=${s#concurrency-full-attn-} step "$s" python3 bench/concurrency.py --smollm2 /tmp/q06 --json "$out/$s.json" ;;
    profile-attn-matmul) PREFIXD_ATTENTION=matmul PATH=/tmp/site/bin:$PATH step profile-attn-matmul python3 bench/probes/daemon_profile.py /tmp/q06 --sessions 1,4,8 --tokens 160 ;;
    ragged-probe) step ragged-probe python3 bench/probes/ragged_step_probe.py /tmp/q06 --mixes 1000x4,8000+300x3,2000x8,8000x4 --steps 30 ;;
    concurrency-ragged) PREFIXD_BATCH_STEP=ragged step concurrency-ragged python3 bench/concurrency.py --smollm2 /tmp/q06 --tokens 200 --json "$out/concurrency-ragged.json" ;;
    concurrency-deep-ragged) PREFIXD_BATCH_STEP=ragged step concurrency-deep-ragged python3 bench/concurrency.py --smollm2 /tmp/q06 --tokens 200 --depth 8000 --json "$out/concurrency-deep-ragged.json" ;;
    join-crowd) step join-crowd python3 bench/probes/join_probe.py /tmp/q06 --crowd 8 --lengths 1000,8000 --json "$out/join-crowd.json" ;;
    front-cost) step front-cost python3 bench/probes/front_cost.py /tmp/lfm2 --tokens 1000 --rounds 3 ;;
    lfm2-profile) PATH=/tmp/site/bin:$PATH step lfm2-profile python3 bench/probes/daemon_profile.py /tmp/lfm2 --sessions 1 --tokens 300 --out "$out/lfm2-profile" ;;
    profile) PATH=/tmp/site/bin:$PATH step profile python3 bench/probes/daemon_profile.py /tmp/q06 --sessions 1,4,8 --tokens 160 --out "$out/profile" ;;
    rowlinear-steps) step rowlinear-steps python3 bench/probes/row_linear_probe.py /tmp/q06 --context 1000 --steps 40 --parts steps,batch ;;
    rowlinear) step rowlinear python3 bench/probes/row_linear_probe.py /tmp/q06 --context 1000 --steps 40 ;;
    concurrency-full) step concurrency-full python3 bench/concurrency.py --smollm2 /tmp/q06 --json "$out/concurrency-full.json" ;;
    concurrency-full-linear-rows) PREFIXD_LINEAR=rows step concurrency-full-linear-rows python3 bench/concurrency.py --smollm2 /tmp/q06 --json "$out/concurrency-full-linear-rows.json" ;;
    concurrency-full-linear-matmul) PREFIXD_LINEAR=matmul step concurrency-full-linear-matmul python3 bench/concurrency.py --smollm2 /tmp/q06 --json "$out/concurrency-full-linear-matmul.json" ;;
    quick-linear-rows) PREFIXD_LINEAR=rows step quick-linear-rows python3 bench/compare.py --quick --model /tmp/q06 --out "$out/quick-linear-rows" ;;
    quick-linear-matmul) PREFIXD_LINEAR=matmul step quick-linear-matmul python3 bench/compare.py --quick --model /tmp/q06 --out "$out/quick-linear-matmul" ;;
    batchstep) step batchstep python3 bench/probes/batch_step_probe.py /tmp/q06 --context 1000 --steps 40 ;;
    probe) step probe python3 bench/probes/shape_probe.py /tmp/q06 --context 3000 --json "$out/probe.json" ;;
    probe-conv) step probe-conv python3 bench/probes/conv_shape_probe.py /tmp/lfm2 --context 1000 --json "$out/probe-conv.json" ;;
    probe-chat) step probe-chat python3 bench/probes/chat_turn_probe.py /tmp/q06 --json "$out/probe-chat.json" ;;
    probe-decode) step probe-decode python3 bench/probes/decode_batch_probe.py /tmp/q06 --json "$out/probe-decode.json" ;;
    probe-decode-nographs) MLX_USE_CUDA_GRAPHS=0 step probe-decode-nographs python3 bench/probes/decode_batch_probe.py /tmp/q06 --json "$out/probe-decode-nographs.json" ;;
    probe-ragged) step probe-ragged python3 bench/probes/first_hit_probe.py /tmp/q06 --parts 4 --json "$out/probe-ragged.json" ;;
    firsthit) step firsthit python3 bench/probes/first_hit_probe.py /tmp/q06 --json "$out/firsthit.json" ;;
    probe-tails) step probe-tails python3 bench/probes/shape_probe.py /tmp/q06 --context 3000 --parts 6,7 --json "$out/probe-tails.json" ;;
    probe-tails-nographs) MLX_USE_CUDA_GRAPHS=0 step probe-tails-nographs python3 bench/probes/shape_probe.py /tmp/q06 --context 3000 --parts 7 ;;
    fuse) step fuse python3 bench/probes/cuda_cache_fuse.py /tmp/q06 ;;
    quick) step quick python3 bench/compare.py --quick --model /tmp/q06 --out "$out/quick" ;;
    quick-share) PREFIXD_FORK=share step quick-share python3 bench/compare.py --quick --model /tmp/q06 --out "$out/quick-share" ;;
    shared-probe) step shared-probe python3 bench/probes/shared_prefix_probe.py /tmp/q06 --depths 1024,4096,16384,32768 --json "$out/shared-probe.json" ;;
    full) step full python3 bench/compare.py --model /tmp/q06 --out "$out/full" ;;
    chunk512) PREFIXD_PREFILL_CHUNK=512 step chunk512 python3 bench/compare.py --quick --model /tmp/q06 --out "$out/chunk512" ;;
    concurrency) step concurrency python3 bench/concurrency.py --smollm2 /tmp/q06 --quick --json "$out/concurrency.json" ;;
    concurrency-deep-alt)  # concurrency-deep-attn-kernel's run (the daemon's default on CUDA) on the prefixd in $ALT_TREE
      alt_prefixd
      PYTHONPATH=/tmp/pfx-alt:${PYTHONPATH#/tmp/pfx:} step concurrency-deep-alt python3 bench/concurrency.py --smollm2 /tmp/q06 --tokens 200 --depth 8000 --json "$out/concurrency-deep-alt.json" ;;
    concurrency-alt)  # the same on the prefixd in $ALT_TREE
      alt_prefixd
      PYTHONPATH=/tmp/pfx-alt:${PYTHONPATH#/tmp/pfx:} step concurrency-alt python3 bench/concurrency.py --smollm2 /tmp/q06 --quick --json "$out/concurrency-alt.json" ;;
    lfm2-quick) step lfm2-quick python3 bench/compare.py --quick --model /tmp/lfm2 --out "$out/lfm2-quick" ;;
    quick-fused) PREFIXD_ATTENTION=fused step quick-fused python3 bench/compare.py --quick --model /tmp/q06 --out "$out/quick-fused" ;;
    quick-nographs) MLX_USE_CUDA_GRAPHS=0 step quick-nographs python3 bench/compare.py --quick --model /tmp/q06 --out "$out/quick-nographs" ;;
    full-nographs) MLX_USE_CUDA_GRAPHS=0 step full-nographs python3 bench/compare.py --model /tmp/q06 --out "$out/full-nographs" ;;
    full-fused) PREFIXD_ATTENTION=fused step full-fused python3 bench/compare.py --model /tmp/q06 --out "$out/full-fused" ;;
    lfm2-quick-fused) PREFIXD_ATTENTION=fused step lfm2-quick-fused python3 bench/compare.py --quick --model /tmp/lfm2 --out "$out/lfm2-quick-fused" ;;
    lfm2-full) step lfm2-full python3 bench/compare.py --model /tmp/lfm2 --out "$out/lfm2-full" ;;
    fairness) PREFIXD_TRACE_STEPS="$out/fairness-steps.jsonl" step fairness python3 bench/fairness.py --quick --model /tmp/q06 --json "$out/fairness.json" ;;
    fairness-full) PREFIXD_TRACE_STEPS="$out/fairness-full-steps.jsonl" step fairness-full python3 bench/fairness.py --model /tmp/q06 --json "$out/fairness-full.json" ;;
    lfm2-fairness) step lfm2-fairness python3 bench/fairness.py --quick --model /tmp/lfm2 --json "$out/lfm2-fairness.json" ;;
    quick-alt)  # compare.py --quick on another tree's prefixd (ALT_TREE: a folder with its daemon/ client/ protocol/)
      alt_prefixd
      PYTHONPATH=/tmp/pfx-alt:${PYTHONPATH#/tmp/pfx:} step quick-alt python3 bench/compare.py --quick --model /tmp/q06 --out "$out/quick-alt" ;;
    agent) step agent python3 bench/agent_workload.py --model /tmp/q06 --out "$out/agent" ;;
    agent-quick) step agent-quick python3 bench/agent_workload.py --quick --model /tmp/q06 --out "$out/agent-quick" ;;
    lfm2-agent) step lfm2-agent python3 bench/agent_workload.py --model /tmp/lfm2 --out "$out/lfm2-agent" ;;
    *) echo "unknown step $s" ;;
  esac
done
find "$out" -name '*.png' -delete
tar -czf "$OUT/gpu_results.tgz" -C "$OUT" raw && rm -rf "$out"
ls -la "$OUT"
