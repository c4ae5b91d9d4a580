#!/usr/bin/env bash
# Issue 35's GPU campaign (new voices), in parts, each a named run of scripts/gpu_campaign.sh:
#
#   OUT=$OUT bash scripts/new_voice_campaign.sh <part> [<part> ...]
#
#   setup         the overlay venv (stage 0) and the real-size bundles of SETUP_MODELS (stage 2), kept while the
#                 machine is warm
#   gpu-tests     the GPU tests (-k "gpu or cuda") of GPU_TESTS: the engine, flow engine, LLM, CosyVoice3 kind,
#                 front-end graphs and vocoder
#   cv2           CosyVoice2 in-process: 1 and 8 new clips against the registered voice, and 8 new clips
#                 while 16 streams play (stage 3) -> $OUT/cv2/engine.json; with CV2_TRACE=1 torch.profiler
#                 traces of one registered request and of 8 new clips until their first chunks ->
#                 $OUT/cv2/trace1.json.gz, $OUT/cv2/trace8.json.gz
#   cv2-no-priority  the same with new voices' prompts on a stream of the default priority (--no-prefix-priority)
#   cv3           CosyVoice3 the same, with an open-loop rate of CV3_RATE under torch's sync debug mode and
#                 (CV3_TRACE=1) torch.profiler traces of 8 new clips until their first chunks, alone and while
#                 16 streams play -> $OUT/cv3/trace8.json.gz, $OUT/cv3/trace8_playing.json.gz
#                 (python scripts/trace_summary.py reads them)
#   cv3-beside    CosyVoice3 with new voices prepared beside the loop (--prepare-beside)
#   cv2-llm-high, cv3-llm-high  CosyVoice2 / CosyVoice3 with the LLM's steps on a high-priority CUDA stream
#                 (--llm-high-priority)
#   cv2-llm-first  CosyVoice2 with the LLM's steps ahead of new voices' prompts on the GPU (the LLM on a
#                 high-priority stream, the prompts at the flow's priority: --no-prefix-priority)
#   cv2-llm-steps, cv3-llm-steps  CosyVoice2 / CosyVoice3 with LLM_STEPS decode steps a replay (--llm-steps-per-replay)
#   cv3-beside-llm-high  CosyVoice3 with both: new voices' prefixes beside the loop while the LLM, ahead of
#                 them on the GPU, decodes their first tokens (CV3_TRACE=1: 8 new clips traced,
#                 $OUT/cv3-beside-llm-high/trace8.json.gz)
#   served        Triton + NVIDIA's client, the API at API_RATES in English and Chinese, voice uploads
#                 (stages 4-7) -> $OUT/served/report.md
#
# Every variable can be set from the environment (ROUNDS, PART_BUDGET_S, CV3_RATE, ...). Each part's log:
# $OUT/<part>.log; its table's rows are printed at its end. Exit status: 1 when any part failed.
# PACK=1: at the end, everything under $OUT packed into $OUT/campaign.tgz (the loose files removed), for a
# machine that hands back only a few files.
set -uo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root" || exit 1

OUT=${OUT:-$repo_root/outputs/new_voices}
ROUNDS=${ROUNDS:-6}                  # each new-clip level this many times (CosyVoice2)
CV3_ROUNDS=${CV3_ROUNDS:-4}
CV3_RATE=${CV3_RATE:-5}              # req/s of cv3's open-loop level under the sync debug mode (0: none)
LLM_STEPS=${LLM_STEPS:-3}            # the llm-steps parts' decode steps a replay
CV3_TRACE=${CV3_TRACE:-1}            # cv3: trace 8 new clips once more, alone and while 16 play (1), or not (0)
CV2_TRACE=${CV2_TRACE:-1}            # cv2: trace one registered request and 8 new clips once more (1), or not (0)
PART_BUDGET_S=${PART_BUDGET_S:-275}  # one stage-3 part, load included
GPU_TESTS=${GPU_TESTS:-tests/test_flow_engine.py tests/test_engine_core.py tests/test_engine_cosyvoice3.py tests/test_llm_engine.py tests/test_frontend_graphs.py tests/test_hift.py}
GPU_TESTS_TIMEOUT=${GPU_TESTS_TIMEOUT:-150}
VENV=${VENV:-/tmp/venv}
SETUP_MODELS=${SETUP_MODELS:-cosyvoice2 cosyvoice3}  # the real-size bundles that setup writes
mkdir -p "$OUT"

engine_part() {  # $1: part name, $2: model, $3: bench_engine.py's extra arguments, $4: rounds, $5: open-loop rate
  local rates="" sync_rate=0
  [ "${5:-0}" != 0 ] && { rates=$5; sync_rate=$5; }
  FRONTEND_BATCHES= ENGINE_MODELS=$2 ENGINE_MODEL=$2 ENGINE_CONCURRENCY=1 ENGINE_REQUESTS_PER_SENDER=2 \
    ENGINE_RATES=$rates ENGINE_PROFILE_RATE=0 ENGINE_SYNC_DEBUG_RATE=$sync_rate ENGINE_NEW_CLIPS="1 8" \
    ENGINE_NEW_CLIP_ROUNDS=$4 ENGINE_NEW_CLIPS_WHILE_PLAYING=16 ENGINE_TIMEOUT=$((PART_BUDGET_S - 5)) \
    TOTAL_BUDGET_S=$PART_BUDGET_S ENGINE_EXTRA_ARGS="$3" OUT="$OUT/$1" VENV=$VENV \
    bash scripts/gpu_campaign.sh 3 3
}

failed=0
for part in "$@"; do
  echo "== $part ($(date -u +%H:%M:%S))"
  case $part in
    setup) { OUT=$OUT/setup VENV=$VENV bash scripts/gpu_campaign.sh 0 0 &&
             OUT=$OUT/setup VENV=$VENV ENGINE_MODELS="$SETUP_MODELS" bash scripts/gpu_campaign.sh 2 2; } ;;
    # shellcheck disable=SC2086
    gpu-tests) timeout "$GPU_TESTS_TIMEOUT" "$VENV/bin/python" -m pytest -q -p no:cacheprovider $GPU_TESTS -k "gpu or cuda" ;;
    cv2) trace=""; [ "$CV2_TRACE" = 1 ] &&
           trace="--trace-registered $OUT/cv2/trace1.json.gz --trace-new-clips $OUT/cv2/trace8.json.gz"
         engine_part cv2 cosyvoice2 "$trace" "$ROUNDS" 0 ;;
    cv2-no-priority) engine_part cv2-no-priority cosyvoice2 --no-prefix-priority "$ROUNDS" 0 ;;
    cv3) trace=""; [ "$CV3_TRACE" = 1 ] &&
           trace="--trace-new-clips $OUT/cv3/trace8.json.gz --trace-while-playing $OUT/cv3/trace8_playing.json.gz"
         engine_part cv3 cosyvoice3 "$trace" "$CV3_ROUNDS" "$CV3_RATE" ;;
    cv3-beside) engine_part cv3-beside cosyvoice3 --prepare-beside "$CV3_ROUNDS" 0 ;;
    cv2-llm-high) engine_part cv2-llm-high cosyvoice2 --llm-high-priority "$ROUNDS" 0 ;;
    cv2-llm-first) engine_part cv2-llm-first cosyvoice2 "--llm-high-priority --no-prefix-priority" "$ROUNDS" 0 ;;
    cv3-llm-high) engine_part cv3-llm-high cosyvoice3 --llm-high-priority "$CV3_ROUNDS" "$CV3_RATE" ;;
    cv2-llm-steps) engine_part cv2-llm-steps cosyvoice2 "--llm-steps-per-replay $LLM_STEPS" "$ROUNDS" 0 ;;
    cv3-llm-steps) engine_part cv3-llm-steps cosyvoice3 "--llm-steps-per-replay $LLM_STEPS" "$CV3_ROUNDS" "$CV3_RATE" ;;
    cv3-beside-llm-high) trace=""; [ "$CV3_TRACE" = 1 ] && trace="--trace-new-clips $OUT/cv3-beside-llm-high/trace8.json.gz"
                         engine_part cv3-beside-llm-high cosyvoice3 "--prepare-beside --llm-high-priority $trace" \
                           "$CV3_ROUNDS" "$CV3_RATE" ;;
    served) GRPC_LEVELS=${GRPC_LEVELS:-1:8 16:32} API_RATES=${API_RATES:-10} API_LANGS=${API_LANGS:-en zh} \
              UPLOAD_ROUNDS=${UPLOAD_ROUNDS:-2} SOCKET_LEVELS=${SOCKET_LEVELS-} OUT=$OUT/served VENV=$VENV \
              bash scripts/gpu_campaign.sh 4 7 ;;
    *) echo "unknown part: $part" >&2; false ;;
  esac > "$OUT/$part.log" 2>&1
  rc=$?
  [ $rc = 0 ] || failed=1
  echo "   rc=$rc; last lines:"; grep -v '^|' "$OUT/$part.log" | tail -n 3
  # bench_engine.py's table is printed again after every level: each row once, in order
  grep -E '^\| [a-z0-9]' "$OUT/$part.log" | awk '!seen[$0]++' | cut -d'|' -f2-27
done
if [ "${PACK:-0}" = 1 ]; then
  packed=$(mktemp -u /tmp/campaign.XXXXXX.tgz)
  tar -czf "$packed" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$packed" "$OUT/campaign.tgz"
fi
exit $failed
