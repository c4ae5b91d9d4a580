#!/usr/bin/env bash
# CosyVoice2 LLM + Step-Audio-2-mini DiT token2wav on Triton, stage by stage:
#   bash run_stepaudio2_dit_token2wav.sh <start_stage> [<stop_stage>]
#   or: bash run_stepaudio2_dit_token2wav.sh --stage N [--stop-stage M]
#
#  -1  Python environment (shared with run.sh)
#   0  models: download (MODEL_SOURCE=huggingface: cosyvoice2_llm, CosyVoice2-0.5B, the token2wav/
#      folder of Step-Audio-2-mini) or generate random-weight bundles (MODEL_SOURCE=tiny|real)
#   1  prepare the LLM (nothing for our PyTorch engine; TensorRT-LLM engine when LLM_BACKEND=trtllm)
#   2  create the Triton model repository: cosyvoice2_dit, the engine core with Step-Audio2's kind
#      (CosyVoice2's LLM prompts and voices, Step-Audio-2-mini's DiT flow + HiFT, the speech
#      tokenizer and speaker encoder in one loop; speech tokens from LLM_URL, or with LLM_URL empty
#      from the LLM in that loop) behind the front door cosyvoice2 also runs on (template model_repo/cosyvoice2)
#   3  start the LLM's OpenAI-compatible server (none with LLM_URL empty), then Triton; returns when
#      both are ready (stop everything this script started with: bash run_stepaudio2_dit_token2wav.sh stop;
#      `... wait` follows both logs until one server dies, stopping both on SIGTERM: containers)
#   4  gRPC benchmark (client_grpc.py, streaming, against cosyvoice2_dit)
#   5  offline synthesis in one process (offline_inference.py --model step_audio2 on the bundle layout
#      of MODELS_DIR: LLM_ENGINE's LLM, then the DiT token2wav offline)
#   6  token2wav alone, streaming (STRATEGY equal|exponential) and offline (token2wav.py --model step_audio2)
#   7  disaggregated serving: the LLM server on GPU 0 and NUM_T2W_SERVERS Triton servers on the
#      other GPUs (T2W_SERVERS_PER_GPU each, distinct ports); on a machine without GPUs they run on
#      the CPU (set NUM_T2W_SERVERS); returns when all are ready
#   8  benchmark every token2wav server of stage 7 at once, one combined report per concurrency
#      (scripts/bench_disaggregated.py)
#
# The LLM server is `python -m cosyserve.llm.openai_server` (LLM_BACKEND=torch) or trtllm-serve
# (LLM_BACKEND=trtllm); the engine reaches it at LLM_URL. Every setting below can be overridden from
# the environment, e.g.
#   MODEL_SOURCE=tiny DEVICE=cpu bash run_stepaudio2_dit_token2wav.sh -1 3 && bash run_stepaudio2_dit_token2wav.sh 4 4
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/lib.sh
source "$repo_root/scripts/lib.sh"
parse_stages "stop wait" "$@"

VENV=${VENV:-$repo_root/.venv}
MODEL_SOURCE=${MODEL_SOURCE:-huggingface}     # huggingface | tiny | real
MODELS_DIR=${MODELS_DIR:-$repo_root/models}
BUNDLE_SEED=${BUNDLE_SEED:-0}
DIT_MODEL_DIR=${DIT_MODEL_DIR:-$MODELS_DIR/Step-Audio-2-mini/token2wav}
COSYVOICE2_DIR=${COSYVOICE2_DIR:-$MODELS_DIR/CosyVoice2-0.5B}   # its spk2info.pt: the registered voices
LLM_DIR=${LLM_DIR:-$MODELS_DIR/cosyvoice2_llm}
LLM_BACKEND=${LLM_BACKEND:-torch}             # torch (ours) | trtllm (trtllm-serve)
TRT_DTYPE=${TRT_DTYPE:-bfloat16}
TRT_WEIGHTS_DIR=${TRT_WEIGHTS_DIR:-$MODELS_DIR/trt_weights_$TRT_DTYPE}
TRT_ENGINES_DIR=${TRT_ENGINES_DIR:-$MODELS_DIR/trt_engines_$TRT_DTYPE}
OUT_DIR=${OUT_DIR:-$repo_root/outputs}
MODEL_REPO=${MODEL_REPO:-$OUT_DIR/model_repo_cosyvoice2_dit}
DECOUPLED_MODE=${DECOUPLED_MODE:-True}        # True = streaming, False = offline
STREAMING_STRATEGY=${STREAMING_STRATEGY:-exponential}   # exponential | equal (the engine's chunk schedule)
DEVICE=${DEVICE:-auto}                        # auto | cpu | cuda
MAX_STREAMS=${MAX_STREAMS:-0}                 # streams at most, past that refused at once; 0: no cap (run.sh)
ADMISSION_MIN_BUFFER_S=${ADMISSION_MIN_BUFFER_S:-0}  # refuse while a stream has less audio buffered; 0: off (run.sh)
REQUEST_TIMEOUT_S=${REQUEST_TIMEOUT_S:-0}     # seconds a request may run; 0: no limit (run.sh)
TEXT_WARM_UP=${TEXT_WARM_UP:-true}              # load the text front-end at start
ENGINE_WARM_UP=${ENGINE_WARM_UP:-auto}        # voice a few requests before ready (auto: on with CUDA)
TRITON_MAX_BATCH_SIZE=${TRITON_MAX_BATCH_SIZE:-1}
MAX_TOKENS=${MAX_TOKENS:-750}                 # speech tokens per request (the engine's LLM limits)
MIN_TOKENS=${MIN_TOKENS:-0}
FRONTEND_BACKEND=${FRONTEND_BACKEND:-auto}   # speech tokenizer + CAM++: auto (torch on CUDA, onnxruntime on CPU) | torch (TF32 on CUDA) | torch-fp32 | onnxruntime
TOKEN2WAV_DTYPE=${TOKEN2WAV_DTYPE:-auto}      # the DiT flow: auto (float16 on CUDA, float32 on CPU) | float16 | bfloat16 | float32
# Voices whose prompt state (the prompt run once through the flow) streams share: ~0.6 MiB per prompt
# frame in float16, ~150 MB for a 5 s prompt
TOKEN2WAV_MAX_VOICES=${TOKEN2WAV_MAX_VOICES:-8}
# Voices uploaded through the HTTP API (empty: <DIT_MODEL_DIR>/voices; give CosyVoice2-0.5B/voices to
# share them with a CosyVoice2 deployment: the features are the same)
VOICES_DIR=${VOICES_DIR:-}
LLM_ENGINE=${LLM_ENGINE:-torch}               # stage 5 (offline_inference.py): torch (in process) | hf | openai (LLM_URL)
# stage 5: every utterance this many seconds long (one value, or LO HI: offline_inference.py
# --fixed-output-seconds; random weights rarely end by themselves); empty: the LLM decides
FIXED_OUTPUT_SECONDS=${FIXED_OUTPUT_SECONDS:-}
HTTP_PORT=${HTTP_PORT:-8000}
GRPC_PORT=${GRPC_PORT:-8001}
METRICS_PORT=${METRICS_PORT:-8002}
LLM_HOST=${LLM_HOST:-127.0.0.1}
LLM_PORT=${LLM_PORT:-8100}
# The LLM server's URL for the engine (stage 3 starts it); empty: no LLM server, the LLM runs in the
# engine's loop (stage 7 needs the server)
LLM_URL=${LLM_URL-http://127.0.0.1:$LLM_PORT/v1}
LLM_MODEL=${LLM_MODEL:-}                      # model id at LLM_URL; empty = the first it lists
LLM_MAX_SLOTS=${LLM_MAX_SLOTS:-64}            # torch engine: concurrent requests
SERVER_LOG=${SERVER_LOG:-$OUT_DIR/tritonserver.log}
SERVER_PID_FILE=${SERVER_PID_FILE:-$OUT_DIR/tritonserver.pid}
LLM_LOG=${LLM_LOG:-$OUT_DIR/llm_server.log}
LLM_PID_FILE=${LLM_PID_FILE:-$OUT_DIR/llm_server.pid}
SERVER_START_TIMEOUT=${SERVER_START_TIMEOUT:-600}
NUM_TASKS=${NUM_TASKS:-4}
DATASET=${DATASET:-}                          # HuggingFace dataset for stages 4/5/8, e.g. yuekai/seed_tts_cosy2
SPLIT_NAME=${SPLIT_NAME:-wenetspeech4tts}
MANIFEST=${MANIFEST:-}                        # or a manifest file: utt|prompt_text|prompt_wav|target_text
TARGET_TEXT=${TARGET_TEXT:-"身临其境，换新体验。塑造开源语音合成新范式，让智能语音更自然。"}
STRATEGY=${STRATEGY:-exponential}             # stage 6 chunk schedule: exponential | equal
T2W_NUM_TOKENS=${T2W_NUM_TOKENS:-"100 250"}   # stage 6: random-token lengths (25 tokens = 1 s)
REFERENCE_AUDIO=${REFERENCE_AUDIO:-$MODELS_DIR/assets/prompt_audio.wav}   # stage 6 prompt
NUM_GPUS=${NUM_GPUS:-}                        # stage 7: default = what nvidia-smi lists
T2W_SERVERS_PER_GPU=${T2W_SERVERS_PER_GPU:-2}
NUM_T2W_SERVERS=${NUM_T2W_SERVERS:-}          # stage 7/8: default T2W_SERVERS_PER_GPU x (NUM_GPUS - 1)
DISAGG_HTTP_BASE=${DISAGG_HTTP_BASE:-17000}   # server i (1-based) listens on base + i
DISAGG_GRPC_BASE=${DISAGG_GRPC_BASE:-18000}
DISAGG_METRICS_BASE=${DISAGG_METRICS_BASE:-16000}
DISAGG_DIR=${DISAGG_DIR:-$OUT_DIR/disaggregated}
BENCH_CONCURRENCY=${BENCH_CONCURRENCY:-"1 2 4"}   # stage 8: concurrent tasks per token2wav server

gpu_count() {
  if [ -n "$NUM_GPUS" ]; then echo "$NUM_GPUS";
  elif command -v nvidia-smi > /dev/null 2>&1; then nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true;
  else echo 0; fi
}

# DEVICE for the processes that take no "auto" (our LLM server, the stage 5/6 scripts).
torch_device() {
  if [ "$DEVICE" != auto ]; then echo "$DEVICE";
  elif [ "$(gpu_count)" -gt 0 ]; then echo cuda; else echo cpu; fi
}

# TOKEN2WAV_DTYPE as a token2wav.py variant (stage 6)
t2w_variant() {
  case "$TOKEN2WAV_DTYPE" in
    auto) if [ "$(torch_device)" = cpu ]; then echo fp32; else echo fp16; fi ;;
    float16|fp16) echo fp16 ;;
    bfloat16|bf16) echo bf16 ;;
    *) echo fp32 ;;
  esac
}

start_llm_server() {
  local cmd
  case "$LLM_BACKEND" in
    torch) cmd=("$PY" -m cosyserve.llm.openai_server --model-dir "$LLM_DIR" --backend torch --device "$(torch_device)"
                --host "$LLM_HOST" --port "$LLM_PORT" --max-slots "$LLM_MAX_SLOTS") ;;
    trtllm)
      # trtllm-serve loads the engine without the CosyVoice2 head bias (docs/deployment.md): the
      # engine then fails requests whose completion holds text tokens, with that explanation.
      cmd=(trtllm-serve serve --tokenizer "$LLM_DIR" "$TRT_ENGINES_DIR" --max_batch_size 64
           --kv_cache_free_gpu_memory_fraction 0.4 --host "$LLM_HOST" --port "$LLM_PORT")
      if command -v mpirun > /dev/null; then cmd=(mpirun -np 1 --allow-run-as-root --oversubscribe "${cmd[@]}"); fi ;;
    *) die "LLM_BACKEND must be torch or trtllm (got $LLM_BACKEND)" ;;
  esac
  start_llm_server_process "$LLM_PID_FILE" "$LLM_LOG" "$LLM_PORT" "${cmd[@]}"
  log "LLM server ready: $LLM_URL"
}

stop_llm_server() {
  stop_llm_server_process "$LLM_PID_FILE"
}

start_triton() {  # start_triton <http> <grpc> <metrics> <log> <pid file>
  "$PY" -m cosyserve.serving.tritonserver start --model-repo "$MODEL_REPO" --http-port "$1" --grpc-port "$2" \
    --metrics-port "$3" --log "$4" --pid-file "$5" --timeout "$SERVER_START_TIMEOUT"
}

# stage 7 servers: one line "<index> <gpu or cpu> <http> <grpc> <metrics>" each
t2w_servers() {
  local gpus n i gpu
  gpus=$(gpu_count)
  n=${NUM_T2W_SERVERS:-$((T2W_SERVERS_PER_GPU * (gpus > 1 ? gpus - 1 : gpus)))}
  [ "$n" -ge 1 ] || die "no token2wav server to run: no GPU found (set NUM_T2W_SERVERS to run them on the CPU)"
  for i in $(seq 1 "$n"); do
    if [ "$gpus" -ge 2 ]; then gpu=$((1 + (i - 1) / T2W_SERVERS_PER_GPU % (gpus - 1)));
    elif [ "$gpus" -eq 1 ]; then gpu=0;   # one GPU: shared with the LLM
    else gpu=cpu; fi
    echo "$i $gpu $((DISAGG_HTTP_BASE + i)) $((DISAGG_GRPC_BASE + i)) $((DISAGG_METRICS_BASE + i))"
  done
}

# Stopping needs bash and the pid files only (scripts/lib.sh: stop_pid_file), not the venv; what
# cannot be stopped is reported and the rest is stopped all the same.
if [ "$stage" = "stop" ]; then
  status=0
  for pid_file in "$SERVER_PID_FILE" "$DISAGG_DIR"/tritonserver_*.pid; do
    [ ! -f "$pid_file" ] || stop_pid_file "$pid_file" tritonserver is_tritonserver || status=1
  done
  stop_llm_server || status=1
  exit "$status"
fi

if [ "$stage" = "wait" ]; then
  use_venv
  tail -F "$SERVER_LOG" "$LLM_LOG" &
  tail_pid=$!
  trap 'kill "$tail_pid"; bash "$repo_root/run_stepaudio2_dit_token2wav.sh" stop; exit 0' TERM INT
  while kill -0 "$(cat "$SERVER_PID_FILE" 2> /dev/null)" 2> /dev/null \
      && { [ -z "$LLM_URL" ] || kill -0 "$(cat "$LLM_PID_FILE" 2> /dev/null)" 2> /dev/null; }; do
    sleep 5 & wait $!
  done
  kill "$tail_pid"
  die "tritonserver or the LLM server has exited"
fi

use_venv
mkdir -p "$OUT_DIR"

if [ "$stage" -le -1 ] && [ "$stop_stage" -ge -1 ]; then
  log "Stage -1: Python environment (shared with run.sh)"
  VENV=$VENV bash "$repo_root/run.sh" -1 -1
  use_venv
fi

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  case "$MODEL_SOURCE" in
    tiny|real)
      log "Stage 0: generating a $MODEL_SOURCE random-weight bundle with the DiT token2wav in $MODELS_DIR"
      "$PY" "$repo_root/scripts/make_model_bundle.py" --size "$MODEL_SOURCE" --seed "$BUNDLE_SEED" \
        --out "$MODELS_DIR" --parts cosyvoice2,llm,step_audio2
      ;;
    huggingface)
      log "Stage 0: downloading cosyvoice2_llm, CosyVoice2-0.5B and Step-Audio-2-mini/token2wav into $MODELS_DIR"
      "$PY" -m cosyserve.download --out "$MODELS_DIR" --source huggingface
      "$PY" - "$MODELS_DIR" <<'EOF'
import sys
import urllib.request
from pathlib import Path

from huggingface_hub import snapshot_download

models = Path(sys.argv[1])
# Only the token2wav/ folder of Step-Audio-2-mini is used (flow, HiFT, CAM++, S3 tokenizer).
snapshot_download(repo_id="stepfun-ai/Step-Audio-2-mini", local_dir=str(models / "Step-Audio-2-mini"),
                  allow_patterns=["token2wav/*"])
missing = [f for f in ("flow.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2_25hz.onnx")
           if not (models / "Step-Audio-2-mini" / "token2wav" / f).exists()]
if missing:
    sys.exit(f"Step-Audio-2-mini/token2wav is missing {missing}: the download is incomplete")
# The default speaker "001" (the spk2info.pt NVIDIA's runtime downloads).
spk2info = models / "CosyVoice2-0.5B" / "spk2info.pt"
if not spk2info.exists():
    urllib.request.urlretrieve(
        "https://raw.githubusercontent.com/qi-hua/async_cosyvoice/main/CosyVoice2-0.5B/spk2info.pt", spk2info)
EOF
      ;;
    *) die "MODEL_SOURCE must be huggingface, tiny or real (got $MODEL_SOURCE)" ;;
  esac
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  case "$LLM_BACKEND" in
    torch) log "Stage 1: LLM_BACKEND=torch needs no build step (the server reads $LLM_DIR)" ;;
    trtllm)
      log "Stage 1: TensorRT-LLM checkpoint ($TRT_WEIGHTS_DIR) and engine ($TRT_ENGINES_DIR)"
      "$PY" "$repo_root/scripts/convert_checkpoint.py" --model_dir "$LLM_DIR" --output_dir "$TRT_WEIGHTS_DIR" \
        --dtype "$TRT_DTYPE"
      trtllm-build --checkpoint_dir "$TRT_WEIGHTS_DIR" --output_dir "$TRT_ENGINES_DIR" --max_batch_size 64 \
        --max_num_tokens 32768 --gemm_plugin "$TRT_DTYPE" --logits_dtype float32
      ;;
    *) die "LLM_BACKEND must be torch or trtllm (got $LLM_BACKEND)" ;;
  esac
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  log "Stage 2: creating the model repository $MODEL_REPO (decoupled=$DECOUPLED_MODE, strategy=$STREAMING_STRATEGY, LLM: ${LLM_URL:-in the engine loop})"
  "$PY" -m cosyserve.serving.model_repository step_audio2 "$MODEL_REPO" --templates "$repo_root/model_repo" \
    --step-audio2-dir "$DIT_MODEL_DIR" --cosyvoice2-dir "$COSYVOICE2_DIR" --llm-dir "$LLM_DIR" --llm-url "$LLM_URL" \
    --llm-model "$LLM_MODEL" --decoupled "$DECOUPLED_MODE" --streaming-strategy "$STREAMING_STRATEGY" --device "$DEVICE" \
    --max-streams "$MAX_STREAMS" --admission-min-buffer-s "$ADMISSION_MIN_BUFFER_S" --request-timeout-s "$REQUEST_TIMEOUT_S" \
    --text-warm-up "$TEXT_WARM_UP" --engine-warm-up "$ENGINE_WARM_UP" --max-tokens "$MAX_TOKENS" --min-tokens "$MIN_TOKENS" \
    --max-batch-size "$TRITON_MAX_BATCH_SIZE" --frontend-backend "$FRONTEND_BACKEND" --token2wav-dtype "$TOKEN2WAV_DTYPE" \
    --token2wav-max-voices "$TOKEN2WAV_MAX_VOICES" --voices-dir "$VOICES_DIR" > /dev/null \
    || die "Stage 2: could not build the model repository"
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log "Stage 3: LLM server (unless LLM_URL is empty), then Triton on ports http=$HTTP_PORT grpc=$GRPC_PORT metrics=$METRICS_PORT (log: $SERVER_LOG)"
  [ -z "$LLM_URL" ] || start_llm_server
  start_triton "$HTTP_PORT" "$GRPC_PORT" "$METRICS_PORT" "$SERVER_LOG" "$SERVER_PID_FILE"
  log "Triton is ready. Stop everything with: bash run_stepaudio2_dit_token2wav.sh stop"
fi

manifest=$OUT_DIR/dit_manifest.txt  # stages 4, 5 and 8 without MANIFEST or DATASET

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  log "Stage 4: gRPC streaming benchmark against cosyvoice2_dit, $NUM_TASKS tasks"
  [ -n "$MANIFEST$DATASET" ] || write_prompt_manifest "$manifest"
  # shellcheck disable=SC2046
  "$PY" "$repo_root/client_grpc.py" --server-addr localhost --server-port "$GRPC_PORT" \
    --model-name cosyvoice2_dit --num-tasks "$NUM_TASKS" --mode streaming $(data_args "$manifest") \
    --log-dir "$OUT_DIR/log_dit_concurrent_tasks_${NUM_TASKS}_streaming" \
    --json-report "$OUT_DIR/log_dit_concurrent_tasks_${NUM_TASKS}_streaming/report.json"
fi

if [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ]; then
  log "Stage 5: offline synthesis in one process (offline_inference.py --model step_audio2, LLM: $LLM_ENGINE)"
  [ -n "$MANIFEST$DATASET" ] || write_prompt_manifest "$manifest"
  llm_args=(--backend "$LLM_ENGINE")
  [ "$LLM_ENGINE" != openai ] || llm_args+=(--openai-base-url "$LLM_URL")
  # shellcheck disable=SC2206
  [ -z "$FIXED_OUTPUT_SECONDS" ] || llm_args+=(--fixed-output-seconds $FIXED_OUTPUT_SECONDS)
  # shellcheck disable=SC2046
  "$PY" "$repo_root/offline_inference.py" --model step_audio2 --model-dir "$MODELS_DIR" "${llm_args[@]}" \
    --device "$(torch_device)" $(data_args "$manifest") --output-dir "$OUT_DIR/dit_offline" --no-progress
fi

if [ "$stage" -le 6 ] && [ "$stop_stage" -ge 6 ]; then
  log "Stage 6: DiT token2wav alone: streaming ($STRATEGY chunks) and offline"
  # the bundles' prompt clip if there is one, else the default speaker of spk2info.pt
  speaker=(--spk2info "$COSYVOICE2_DIR/spk2info.pt")
  [ ! -f "$REFERENCE_AUDIO" ] || speaker=(--reference-audio "$REFERENCE_AUDIO")
  for mode in streaming offline; do
    # shellcheck disable=SC2086
    "$PY" "$repo_root/token2wav.py" --model step_audio2 --model-dir "$DIT_MODEL_DIR" --device "$(torch_device)" \
      --variants "$(t2w_variant)" --mode "$mode" --strategy "$STRATEGY" --num-tokens $T2W_NUM_TOKENS "${speaker[@]}" --runs 3
  done
fi

if [ "$stage" -le 7 ] && [ "$stop_stage" -ge 7 ]; then
  log "Stage 7: disaggregated serving: LLM server on GPU 0, token2wav Triton servers on the others"
  [ -n "$LLM_URL" ] || die "Stage 7 serves the LLM apart: set LLM_URL (and build the repository with it: stage 2)"
  mkdir -p "$DISAGG_DIR"
  servers=$(t2w_servers)
  if [ "$(gpu_count)" -gt 0 ]; then CUDA_VISIBLE_DEVICES=0 start_llm_server; else start_llm_server; fi
  pids=()
  while read -r i gpu http grpc metrics; do
    log "token2wav server $i (GPU: $gpu): http $http, grpc $grpc, metrics $metrics (log: $DISAGG_DIR/tritonserver_$i.log)"
    visible=$gpu
    [ "$gpu" != cpu ] || visible=""   # no GPU visible: the models run on the CPU
    CUDA_VISIBLE_DEVICES=$visible start_triton "$http" "$grpc" "$metrics" "$DISAGG_DIR/tritonserver_$i.log" \
      "$DISAGG_DIR/tritonserver_$i.pid" &
    pids+=($!)
  done <<< "$servers"
  for pid in "${pids[@]}"; do wait "$pid" || die "a token2wav server failed to start (logs: $DISAGG_DIR)"; done
  log "all token2wav servers are ready. Stop everything with: bash run_stepaudio2_dit_token2wav.sh stop"
fi

if [ "$stage" -le 8 ] && [ "$stop_stage" -ge 8 ]; then
  log "Stage 8: benchmark across the token2wav servers, $BENCH_CONCURRENCY concurrent tasks per server"
  [ -n "$MANIFEST$DATASET" ] || write_prompt_manifest "$manifest"
  servers=$(t2w_servers | awk '{printf "localhost:%s ", $4}')
  # shellcheck disable=SC2046,SC2086
  "$PY" "$repo_root/scripts/bench_disaggregated.py" --servers $servers --model-name cosyvoice2_dit \
    --num-tasks $BENCH_CONCURRENCY $(data_args "$manifest") --log-dir "$DISAGG_DIR/bench"
fi
