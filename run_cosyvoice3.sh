#!/usr/bin/env bash
# CosyVoice3 (Fun-CosyVoice3-0.5B-2512) on Triton, stage by stage:
#     bash run_cosyvoice3.sh <start_stage> [<stop_stage>]   or   --stage N [--stop-stage M]
#
#  -1  Python environment (venv + requirements + this package; run.sh's stage -1)
#   0  models: download (MODEL_SOURCE=huggingface|modelscope) or generate random-weight bundles
#      with the released file names and formats (MODEL_SOURCE=tiny|real, no network needed)
#   1  prepare the LLM: nothing for our PyTorch engine (it reads the HF checkpoint); a TensorRT-LLM
#      engine is not built for CosyVoice3 yet (see README)
#   2  create the Triton model repository: cosyvoice3, the engine core (LLM, DiT flow, causal HiFT,
#      speech tokenizer and speaker encoder in one loop; speech tokens from LLM_URL when set) behind
#      the front door that cosyvoice2 also runs on (template model_repo/cosyvoice2)
#   3  launch Triton (returns when the server is ready; stop it with: bash run_cosyvoice3.sh stop)
#   4  gRPC benchmark (client_grpc.py --model-name cosyvoice3, NVIDIA's client flags)
#   5  offline benchmark (offline_inference.py --model cosyvoice3; no server needed)
#
# Every setting below can be overridden from the environment, e.g.
#   MODEL_SOURCE=tiny bash run_cosyvoice3.sh -1 3 && bash run_cosyvoice3.sh 4
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/lib.sh
source "$repo_root/scripts/lib.sh"
parse_stages stop "$@"

VENV=${VENV:-$repo_root/.venv}
MODEL_SOURCE=${MODEL_SOURCE:-huggingface}     # huggingface | modelscope | tiny | real
MODELS_DIR=${MODELS_DIR:-$repo_root/models}   # Fun-CosyVoice3-0.5B-2512/ and cosyvoice3_llm/ in it
BUNDLE_SEED=${BUNDLE_SEED:-0}
LLM_ENGINE=${LLM_ENGINE:-torch}               # stage 5 (offline_inference.py): our engine (torch) | hf
# http://HOST:PORT/v1 of OpenAI-compatible completions servers of the CosyVoice3 LLM (comma-separated; e.g.
# python -m cosyserve.llm.openai_server --model-dir $MODELS_DIR/cosyvoice3_llm, or trtllm-serve as the
# reference runs it): speech tokens come from there and the repository gets no Triton llm model
LLM_URL=${LLM_URL:-}
MODEL_REPO=${MODEL_REPO:-$repo_root/outputs/model_repo_cosyvoice3}
DECOUPLED_MODE=${DECOUPLED_MODE:-True}        # True = streaming, False = offline
STREAMING_STRATEGY=${STREAMING_STRATEGY:-exponential}   # exponential | time_based (as CosyVoice2's BLS)
DEVICE=${DEVICE:-auto}                        # auto | cpu | cuda
MAX_STREAMS=${MAX_STREAMS:-0}                 # streams at most, past that refused at once; 0: no cap (run.sh)
ADMISSION_MIN_BUFFER_S=${ADMISSION_MIN_BUFFER_S:-0}  # refuse while a stream has less audio buffered; 0: off (run.sh)
REQUEST_TIMEOUT_S=${REQUEST_TIMEOUT_S:-0}     # seconds a request may run; 0: no limit (run.sh)
TEXT_WARM_UP=${TEXT_WARM_UP:-true}              # load the text front-end at start
ENGINE_WARM_UP=${ENGINE_WARM_UP:-auto}        # capture every graph and voice a few requests before ready (auto: on with CUDA)
# Voices uploaded through the HTTP API (empty: <model dir>/voices). Give a CosyVoice2 deployment's
# (its CosyVoice2-0.5B/voices) so that one API serves a voice with both models (docs/api.md).
VOICES_DIR=${VOICES_DIR:-}
# Speech tokens per request at most: 750 (30 s) as the reference; random weights rarely stop, so
# the tiny bundle stops at 200 (8 s) to keep CPU runs short.
MAX_TOKENS=${MAX_TOKENS:-$([ "$MODEL_SOURCE" = tiny ] && echo 200 || echo 750)}
MIN_TOKENS=${MIN_TOKENS:-0}
TRITON_MAX_BATCH_SIZE=${TRITON_MAX_BATCH_SIZE:-1}    # the reference's
FRONTEND_BACKEND=${FRONTEND_BACKEND:-auto}   # speech tokenizer + CAM++: auto (torch on CUDA, onnxruntime on CPU) | torch (TF32 on CUDA) | torch-fp32 | onnxruntime
TOKEN2WAV_DTYPE=${TOKEN2WAV_DTYPE:-auto}      # the DiT flow: auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float16 | float32
# Streaming flow: true = incremental (block-masked DiT, only the new frames); false = the reference's
# full-attention re-run over the whole prefix every chunk (docs/benchmarks.md compares them)
TOKEN2WAV_INCREMENTAL_STREAM=${TOKEN2WAV_INCREMENTAL_STREAM:-true}
# Voices whose prompt-only flow states incremental streams share (~360 MB each in bfloat16 for a 5 s prompt)
TOKEN2WAV_MAX_VOICES=${TOKEN2WAV_MAX_VOICES:-8}
# The packed flow steps replayed from CUDA graphs: auto (on with CUDA) | true | false
TOKEN2WAV_CUDA_GRAPHS=${TOKEN2WAV_CUDA_GRAPHS:-auto}
HTTP_PORT=${HTTP_PORT:-18000}                 # the reference's Triton ports
GRPC_PORT=${GRPC_PORT:-18001}
METRICS_PORT=${METRICS_PORT:-18002}
SERVER_LOG=${SERVER_LOG:-$repo_root/outputs/tritonserver_cosyvoice3.log}
SERVER_PID_FILE=${SERVER_PID_FILE:-$repo_root/outputs/tritonserver_cosyvoice3.pid}
SERVER_START_TIMEOUT=${SERVER_START_TIMEOUT:-600}
NUM_TASKS=${NUM_TASKS:-4}
CLIENT_MODE=${CLIENT_MODE:-}                  # default: streaming if DECOUPLED_MODE=True
DATASET=${DATASET:-}                          # HuggingFace dataset for stage 4, e.g. yuekai/seed_tts_cosy2
SPLIT_NAME=${SPLIT_NAME:-wenetspeech4tts}
MANIFEST=${MANIFEST:-}                        # or a manifest file: utt|prompt_text|prompt_wav|target_text
OUT_DIR=${OUT_DIR:-$repo_root/outputs}
TARGET_TEXT=${TARGET_TEXT:-"身临其境，换新体验。塑造开源语音合成新范式，让智能语音更自然。"}

if [ "$stage" = "stop" ]; then  # bash and the pid file only (scripts/lib.sh), not the venv
  stop_pid_file "$SERVER_PID_FILE" tritonserver is_tritonserver
  exit 0
fi

use_venv
mkdir -p "$OUT_DIR"

if [ "$stage" -le -1 ] && [ "$stop_stage" -ge -1 ]; then
  log "Stage -1: Python environment (run.sh stage -1)"
  VENV=$VENV bash "$repo_root/run.sh" -1 -1
  use_venv
fi

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  case "$MODEL_SOURCE" in
    tiny|real)
      log "Stage 0: generating a $MODEL_SOURCE random-weight CosyVoice3 bundle in $MODELS_DIR"
      "$PY" "$repo_root/scripts/make_model_bundle.py" --size "$MODEL_SOURCE" --seed "$BUNDLE_SEED" --out "$MODELS_DIR" \
        --parts cosyvoice3,cosyvoice3_llm
      ;;
    huggingface|modelscope)
      log "Stage 0: downloading CosyVoice3 from $MODEL_SOURCE (the LLM from the HuggingFace Hub) into $MODELS_DIR"
      "$PY" -m cosyserve.download --model cosyvoice3 --out "$MODELS_DIR" --source "$MODEL_SOURCE"
      ;;
    *) die "MODEL_SOURCE must be huggingface, modelscope, tiny or real (got $MODEL_SOURCE)" ;;
  esac
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log "Stage 1: our engine needs no build step (it reads $MODELS_DIR/cosyvoice3_llm)"
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  log "Stage 2: creating the model repository $MODEL_REPO (decoupled=$DECOUPLED_MODE)"
  "$PY" -m cosyserve.serving.model_repository cosyvoice3 "$MODEL_REPO" --templates "$repo_root/model_repo" \
    --models-dir "$MODELS_DIR" --llm-url "$LLM_URL" --decoupled "$DECOUPLED_MODE" \
    --streaming-strategy "$STREAMING_STRATEGY" --device "$DEVICE" --max-streams "$MAX_STREAMS" \
    --admission-min-buffer-s "$ADMISSION_MIN_BUFFER_S" --request-timeout-s "$REQUEST_TIMEOUT_S" \
    --text-warm-up "$TEXT_WARM_UP" --engine-warm-up "$ENGINE_WARM_UP" --max-tokens "$MAX_TOKENS" \
    --min-tokens "$MIN_TOKENS" --max-batch-size "$TRITON_MAX_BATCH_SIZE" --frontend-backend "$FRONTEND_BACKEND" \
    --token2wav-dtype "$TOKEN2WAV_DTYPE" --token2wav-incremental-stream "$TOKEN2WAV_INCREMENTAL_STREAM" \
    --token2wav-max-voices "$TOKEN2WAV_MAX_VOICES" --token2wav-cuda-graphs "$TOKEN2WAV_CUDA_GRAPHS" \
    --voices-dir "$VOICES_DIR" > /dev/null \
    || die "Stage 2: could not build the model repository"
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log "Stage 3: launching Triton on ports http=$HTTP_PORT grpc=$GRPC_PORT metrics=$METRICS_PORT (log: $SERVER_LOG)"
  "$PY" -m cosyserve.serving.tritonserver start --model-repo "$MODEL_REPO" \
    --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" --metrics-port "$METRICS_PORT" \
    --log "$SERVER_LOG" --pid-file "$SERVER_PID_FILE" --timeout "$SERVER_START_TIMEOUT"
  log "Triton is ready. Stop it with: bash run_cosyvoice3.sh stop"
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  mode=${CLIENT_MODE:-$([ "$DECOUPLED_MODE" = True ] && echo streaming || echo offline)}
  manifest=$OUT_DIR/cosyvoice3_manifest.txt  # without MANIFEST or DATASET: the bundled prompt
  log "Stage 4: gRPC benchmark, $NUM_TASKS tasks, mode=$mode"
  [ -n "$MANIFEST$DATASET" ] || write_prompt_manifest "$manifest"
  # shellcheck disable=SC2046
  "$PY" "$repo_root/client_grpc.py" --server-addr localhost --server-port "$GRPC_PORT" \
    --model-name cosyvoice3 --num-tasks "$NUM_TASKS" --mode "$mode" $(data_args "$manifest") \
    --log-dir "$OUT_DIR/log_cosyvoice3_concurrent_tasks_${NUM_TASKS}_${mode}"
fi

if [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ]; then
  manifest=$OUT_DIR/cosyvoice3_manifest.txt
  log "Stage 5: offline benchmark (offline_inference.py --model cosyvoice3)"
  [ -n "$MANIFEST$DATASET" ] || write_prompt_manifest "$manifest"
  # shellcheck disable=SC2046
  "$PY" "$repo_root/offline_inference.py" --model cosyvoice3 --model-dir "$MODELS_DIR" --backend "$LLM_ENGINE" \
    $(data_args "$manifest") --output-dir "$OUT_DIR/offline_inference_cosyvoice3"
fi
