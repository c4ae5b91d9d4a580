#!/usr/bin/env bash
# One GPU call, start to end: overlay venv from carried wheels, environment report, a random-weight
# bundle, the engine in-process (bench_engine.py), Triton + NVIDIA's client (client_grpc.py), the
# OpenAI-compatible API under open-loop load (bench_api.py, English and Chinese texts), a table.
#
#   bash scripts/gpu_campaign.sh [<stage> [<stop_stage>]]      (or --stage N --stop-stage M,
#   or stage=N stop_stage=M in the environment); default: stages 0..7 (everything but -1). Every
#   variable below can be set from the environment.
#
#  -1  wheels: download into WHEEL_DIR what the GPU image lacks (needs PyPI; run it here, not there)
#   0  overlay venv: scripts/overlay_venv.sh $VENV $BASE_PYTHON $WHEEL_DIR/*.whl (MAKE_VENV=auto: only
#      when $VENV/bin/python is missing, so VENV=.venv on a development machine skips it)
#   1  environment: nvidia-smi, torch/numpy/package versions, git HEAD
#   2  bundle: MODEL_SOURCE=real|tiny random-weight bundle in MODELS_DIR (run.sh 0 0; once: kept if there)
#   3  engine in-process: bench_frontend.py (new voices' front end: tokenizer, CAM++, the whole voice)
#      -> $OUT/frontend.md, then bench_engine.py (with new clips, alone and while streams play)
#      -> $OUT/engine.json
#   4  Triton: run.sh 2 3 (no API), client_grpc.py at GRPC_LEVELS -> $OUT/triton_grpc.json
#   5  API: python -m cosyserve.api next to that Triton (run.sh's command), bench_api.py at each of
#      API_RATES with the texts of each of API_LANGS in turn -> $OUT/api.json; then the text-in
#      WebSocket, bench_text_socket.py at SOCKET_LEVELS sockets at once -> $OUT/sockets.json; first (idle
#      server) bench_voice_upload.py: UPLOAD_ROUNDS voices uploaded and spoken at once -> $OUT/voice_upload.json
#   6  stop: bash run.sh stop (the API and Triton; also done on exit whenever stage 4 or 5 ran)
#   7  report: scripts/campaign_report.py -> $OUT/report.md (printed)
#
# Each stage runs under its own `timeout`, capped by what is left of TOTAL_BUDGET_S (RESERVE_S kept
# for stop + report); a failed or timed-out stage is logged and the next one runs. Everything printed
# also goes to $OUT/campaign.log. Files in $OUT: campaign.log, engine.json, triton_grpc.json, api.json,
# report.md. Exit status: 0 when every stage that ran passed, 1 otherwise.
#
# On the GPU machine (carry .whl):
#   OUT=$OUT bash scripts/gpu_campaign.sh
# CPU smoke test (the development venv, tiny bundle, tiny loads):
#   VENV=.venv MODEL_SOURCE=tiny MODELS_DIR=/tmp/models_tiny TOKENS=20 ENGINE_CONCURRENCY=1 \
#   ENGINE_REQUESTS_PER_SENDER=1 ENGINE_RATES=1 ENGINE_SECONDS_PER_RATE=2 GRPC_LEVELS="1:1 2:2" \
#   API_RATES=1 API_REQUESTS_PER_RATE=2 OUT=/tmp/campaign_out bash scripts/gpu_campaign.sh
set -uo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root" || exit 1
# shellcheck source=scripts/lib.sh
source "$repo_root/scripts/lib.sh"
# icefall style: stage / stop_stage from the environment (or STAGE / STOP_STAGE), else the arguments
env_stage=${stage:-${STAGE:-0}} env_stop_stage=${stop_stage:-${STOP_STAGE:-7}}
parse_stages "" "$@"
[ $# -gt 0 ] || { stage=$env_stage; stop_stage=$env_stop_stage; }

OUT=${OUT:-$repo_root/outputs/campaign}
WORK=${WORK:-/tmp/campaign}                  # per-level JSONs, client wavs, prompt texts
TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-530}        # the whole script, from its start
RESERVE_S=${RESERVE_S:-20}                   # kept for stop + report
MIN_STAGE_S=${MIN_STAGE_S:-20}               # a stage with less time left than this is skipped

# stage -1 / 0: wheels and the overlay venv
WHEEL_DIR=${WHEEL_DIR:-$repo_root/.whl}
BASE_PYTHON=${BASE_PYTHON:-/opt/torch/.venv/bin/python3}
VENV=${VENV:-/tmp/venv}
MAKE_VENV=${MAKE_VENV:-auto}                 # auto (when $VENV/bin/python is missing) | true | false
HIDE_MODULES=${HIDE_MODULES-scipy sklearn}   # base packages built for numpy 2 that must look absent
VENV_TIMEOUT=${VENV_TIMEOUT:-150}

# stage 2: bundle
MODEL_SOURCE=${MODEL_SOURCE:-real}
MODELS_DIR=${MODELS_DIR:-/tmp/models}
BUNDLE_TIMEOUT=${BUNDLE_TIMEOUT:-150}

# every reply: exactly TOKENS speech tokens (random weights never stop by themselves)
TOKENS=${TOKENS:-150}
MIN_TOKENS=${MIN_TOKENS:-$TOKENS}
MAX_TOKENS=${MAX_TOKENS:-$TOKENS}

# stage 3: engine in-process
ENGINE_MODEL=${ENGINE_MODEL:-cosyvoice2}            # its report: engine.json
ENGINE_MODELS=${ENGINE_MODELS:-$ENGINE_MODEL}        # each in turn; the others' reports: engine_<model>.json
ENGINE_DEVICE=${ENGINE_DEVICE:-auto}
ENGINE_CONCURRENCY=${ENGINE_CONCURRENCY:-1 16}
ENGINE_REQUESTS_PER_SENDER=${ENGINE_REQUESTS_PER_SENDER:-2}
ENGINE_RATES=${ENGINE_RATES-8 12 16 20}            # (empty: no open-loop level)
ENGINE_SECONDS_PER_RATE=${ENGINE_SECONDS_PER_RATE:-10}
ENGINE_PROFILE_RATE=${ENGINE_PROFILE_RATE:-8}       # a last level under torch.profiler (0: none)
ENGINE_PROFILE_SECONDS=${ENGINE_PROFILE_SECONDS:-3}
ENGINE_SYNC_DEBUG_RATE=${ENGINE_SYNC_DEBUG_RATE:-8}  # then one under torch's sync debug mode (0: none)
ENGINE_NEW_CLIPS=${ENGINE_NEW_CLIPS-1 8}           # never-seen 3-8 s clips arriving together (empty: none)
ENGINE_NEW_CLIPS_WHILE_PLAYING=${ENGINE_NEW_CLIPS_WHILE_PLAYING-16}  # those again while this many streams play
ENGINE_NEW_CLIP_ROUNDS=${ENGINE_NEW_CLIP_ROUNDS:-5}  # each new-clip level this many times, fresh clips each
ENGINE_EXTRA_ARGS=${ENGINE_EXTRA_ARGS:-}
ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-200}
FRONTEND_BATCHES=${FRONTEND_BATCHES-1,8}           # bench_frontend.py's batch sizes (empty: not run)
FRONTEND_BACKENDS=${FRONTEND_BACKENDS:-torch,torch-fp32}  # ... and its back ends (TF32, what servers run; exact)
FRONTEND_TIMEOUT=${FRONTEND_TIMEOUT:-120}

# stage 4: Triton (run.sh's variables pass through: DEVICE, CUDA_MPS, ports, ...) and client_grpc.py
GRPC_PORT=${GRPC_PORT:-8001}
SERVER_START_TIMEOUT=${SERVER_START_TIMEOUT:-170}   # run.sh's own wait for ready (it then stops the server)
TRITON_START_TIMEOUT=${TRITON_START_TIMEOUT:-$((SERVER_START_TIMEOUT + 30))}
GRPC_LEVELS=${GRPC_LEVELS-1:24 16:64 64:128}         # concurrent streams:requests (empty: none)
GRPC_LEVEL_TIMEOUT=${GRPC_LEVEL_TIMEOUT:-90}
GRPC_REQUEST_TIMEOUT=${GRPC_REQUEST_TIMEOUT:-120}
GRPC_TARGET_TEXT=${GRPC_TARGET_TEXT:-收到好友从远方寄来的生日礼物}
SPEAKER_ID=${SPEAKER_ID:-001}

# stage 5: the API and bench_api.py
API_PORT=${API_PORT:-8080}
API_START_TIMEOUT=${API_START_TIMEOUT:-90}
API_LANGS=${API_LANGS:-en zh}
API_RATES=${API_RATES-10 15 20}                    # (empty: none)
API_SECONDS_PER_RATE=${API_SECONDS_PER_RATE:-10}   # bench_api.py sends at least 10 requests a rate
API_REQUESTS_PER_RATE=${API_REQUESTS_PER_RATE:-}    # instead of seconds: this many a rate
API_REQUEST_TIMEOUT=${API_REQUEST_TIMEOUT:-30}   # a request still unfinished then counts as failed
SOCKET_LEVELS=${SOCKET_LEVELS-1 16}           # text-in sockets at once (empty: none)
UPLOAD_ROUNDS=${UPLOAD_ROUNDS:-5}             # voices uploaded and spoken at once (bench_voice_upload.py; 0: none)
UPLOAD_SECONDS=${UPLOAD_SECONDS:-10}          # each upload's WAV
UPLOAD_TIMEOUT=${UPLOAD_TIMEOUT:-60}
SOCKET_CHARS_PER_S=${SOCKET_CHARS_PER_S:-20}  # how fast each socket's text is sent
SOCKET_TIMEOUT=${SOCKET_TIMEOUT:-90}
API_RATE_TIMEOUT=${API_RATE_TIMEOUT:-$((API_SECONDS_PER_RATE + API_REQUEST_TIMEOUT + 20))}  # one rate, one language
API_TEXTS_EN=${API_TEXTS_EN:-"Hello! Thanks for calling. How can I help you today?
The quick brown fox jumps over the lazy dog near the quiet river bank.
Your appointment is confirmed for March 3rd at 4:30 pm, room 12."}
API_TEXTS_ZH=${API_TEXTS_ZH:-"收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。
今天天气很好，我们一起去公园散步吧。
会议定于2024年3月3日下午4点30分在12号会议室开始。"}

MODEL_REPO=${MODEL_REPO:-$repo_root/outputs/model_repo_cosyvoice2}
SERVER_PID_FILE=${SERVER_PID_FILE:-$repo_root/outputs/tritonserver.pid}
SERVER_LOG=${SERVER_LOG:-$repo_root/outputs/tritonserver.log}
API_PID_FILE=${API_PID_FILE:-$repo_root/outputs/api.pid}
API_LOG=${API_LOG:-$repo_root/outputs/api.log}
export VENV MODEL_SOURCE MODELS_DIR MIN_TOKENS MAX_TOKENS GRPC_PORT SERVER_START_TIMEOUT MODEL_REPO \
  SERVER_PID_FILE SERVER_LOG API_PID_FILE API_LOG API_PORT
export HIDE_MODULES PYTHONUNBUFFERED=1 TQDM_DISABLE=${TQDM_DISABLE:-1}

mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/campaign.log") 2>&1
STATUS_FILE=$WORK/stages.tsv
: > "$STATUS_FILE"
rm -f "$WORK/env.txt" "$WORK/triton_ready.txt"
failures=0
server_touched=false

record() {  # record NAME STATE: a step that did not run (e.g. its server was not ready), as failed
  log "$1: $2"
  printf '%s\t%s\t-\t0\n' "$1" "$2" >> "$STATUS_FILE"
  failures=$((failures + 1))
}

wanted() { [ "$stage" -le "$1" ] && [ "$stop_stage" -ge "$1" ]; }

# step NAME LIMIT_S CMD...: CMD under timeout (LIMIT_S, capped by the budget left), its status in STATUS_FILE
step() {
  local name=$1 limit=$2 left start rc
  shift 2
  left=$((TOTAL_BUDGET_S - RESERVE_S - SECONDS))
  if [ "$left" -lt "$MIN_STAGE_S" ]; then
    record "$name" "skipped: ${left} s of the budget left"
    return 124
  fi
  [ "$limit" -le "$left" ] || limit=$left
  log "BEGIN $name (timeout ${limit} s): $*"
  start=$SECONDS
  timeout -k 10 "$limit" "$@"
  rc=$?
  local state=ok
  [ "$rc" -eq 0 ] || state=failed
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || state=timeout
  log "END $name: $state (exit $rc) after $((SECONDS - start)) s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$state" "$rc" "$((SECONDS - start))" >> "$STATUS_FILE"
  [ "$rc" -eq 0 ] || failures=$((failures + 1))
  return "$rc"
}

tail_log() {  # tail_log FILE: its last lines into this log (after a failure)
  [ -f "$1" ] || return 0
  echo "----- last 40 lines of $1 -----"
  tail -n 40 "$1"
  echo "-----"
}

stop_servers() {
  $server_touched || return 0
  server_touched=false
  log "stopping the API and Triton (bash run.sh stop)"
  bash "$repo_root/run.sh" stop || log "run.sh stop reported a problem"
  # a launcher killed by its timeout before ready leaves a server without a pid file: ours by its repository
  local pid
  for pid in $(pgrep -f -- "--model-repository=$(realpath -m "$MODEL_REPO")" 2>/dev/null); do
    log "killing leftover tritonserver pid $pid ($MODEL_REPO)"
    kill -9 -- "-$pid" 2>/dev/null || kill -9 "$pid" 2>/dev/null  # its group: the stubs too
  done
}
trap stop_servers EXIT

log "gpu_campaign: stages $stage..$stop_stage, budget ${TOTAL_BUDGET_S} s, OUT=$OUT, VENV=$VENV, MODEL_SOURCE=$MODEL_SOURCE"

# --- -1: wheels (on a machine with PyPI) ----------------------------------------------------------
# The GPU image lacks these (docs: /work/.library/device KINDS.md package list). nvidia-pytriton is
# slimmed (the Python 3.8-3.11/3.13 backend stubs and the libpython 3.13 bundled for one of them are
# dropped; Python 3.12 uses its own) and, with numpy and wetext, recompressed with LZMA (a zip method
# pip reads), so that everything travels in one call (the working tree's limit is 64 MiB).
WHEELS=(
  nvidia-pytriton==0.7.0 numpy==1.26.4 tritonclient==2.73.0 python-rapidjson==1.25
  soundfile==0.14.0 cffi==2.1.1 pycparser==3.12
  wetext==0.1.8 kaldifst==1.8.3 contractions==0.1.73 textsearch==0.0.24 anyascii==0.3.3 pyahocorasick==2.3.1
  inflect==7.6.0 jaraco.functools==4.6.0 more-itertools==11.2.1 typeguard==4.6.1
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 uvicorn==0.54.0
  python-multipart==0.0.34 pyzmq==27.3.0 sh==2.4.0 importlib-metadata==8.9.0 websockets==15.0.1
)
if wanted -1; then
  log "Stage -1: downloading ${#WHEELS[@]} wheels into $WHEEL_DIR"
  mkdir -p "$WHEEL_DIR"
  platforms=()
  for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 \
           manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do platforms+=(--platform "${p}_x86_64"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$WHEEL_DIR" "${WHEELS[@]}" || die "pip download failed"
  python3 - "$WHEEL_DIR" <<'EOF' || die "could not repack the wheels"
import re, sys, zipfile
from pathlib import Path
drop = re.compile(r"python_backend_stubs/3\.(8|9|10|11|13)/|nvidia_pytriton\.libs/libpython3-")
for pattern in ("nvidia_pytriton-*.whl", "numpy-*.whl", "wetext-*.whl"):
    for wheel in Path(sys.argv[1]).glob(pattern):
        with zipfile.ZipFile(wheel) as src:
            if all(i.compress_type == zipfile.ZIP_LZMA for i in src.infolist() if i.file_size):
                continue  # repacked already
            tmp = wheel.with_suffix(".tmp")
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_LZMA) as out:
                for info in src.infolist():
                    if drop.search(info.filename):
                        continue
                    data = src.read(info)
                    if info.filename.endswith(".dist-info/RECORD"):
                        data = "".join(l for l in data.decode().splitlines(True) if not drop.search(l)).encode()
                    new = zipfile.ZipInfo(info.filename, info.date_time)
                    new.external_attr, new.compress_type = info.external_attr, zipfile.ZIP_LZMA
                    out.writestr(new, data)
        size = wheel.stat().st_size
        tmp.replace(wheel)
        print(f"repacked {wheel.name}: {size / 2**20:.1f} -> {wheel.stat().st_size / 2**20:.1f} MiB")
EOF
  du -ch "$WHEEL_DIR"/*.whl | tail -n 1
fi

# --- 0: overlay venv ------------------------------------------------------------------------------------
if wanted 0; then
  make=$MAKE_VENV
  [ "$make" != auto ] || { [ -x "$VENV/bin/python" ] && make=false || make=true; }
  if [ "$make" = true ]; then
    shopt -s nullglob
    wheels=("$WHEEL_DIR"/*.whl)
    shopt -u nullglob
    log "Stage 0: overlay venv $VENV over $BASE_PYTHON with ${#wheels[@]} wheels (HIDE_MODULES=$HIDE_MODULES)"
    rm -rf "$VENV"
    step venv "$VENV_TIMEOUT" bash "$repo_root/scripts/overlay_venv.sh" "$VENV" \
      "$BASE_PYTHON" "${wheels[@]}"
  else
    log "Stage 0: using the existing $VENV (MAKE_VENV=$MAKE_VENV)"
  fi
fi
use_venv   # PATH=$VENV/bin:..., PY
log "python: $PY"

# --- 1: environment -------------------------------------------------------------------------------------
if wanted 1; then
  log "Stage 1: environment"
  {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  nproc
  git -C "$repo_root" log -1 --format='git %H %cd %s' 2>&1 || echo "no git history"
  echo "uncommitted: $(git -C "$repo_root" status --short 2>/dev/null | wc -l) paths"
  "$PY" - <<'EOF' 2>&1
import importlib.metadata as md, sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for name in ("numpy", "transformers", "onnxruntime", "nvidia-pytriton", "tritonclient", "grpcio", "protobuf",
             "fastapi", "uvicorn", "wetext", "pyzmq", "msgpack", "triton"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
EOF
  } 2>&1 | tee "$WORK/env.txt"
fi

# --- 2: bundle ------------------------------------------------------------------------------------------
if wanted 2; then
  if [ -f "$MODELS_DIR/assets/prompt_audio.wav" ] && [ -d "$MODELS_DIR/cosyvoice2_llm" ]; then
    log "Stage 2: the bundle in $MODELS_DIR is there already"
  else
    step bundle "$BUNDLE_TIMEOUT" bash "$repo_root/run.sh" 0 0
  fi
  case " $ENGINE_MODELS " in *" cosyvoice3 "*)  # its own bundle (run_cosyvoice3.sh's), next to CosyVoice2's
    if [ ! -d "$MODELS_DIR/cosyvoice3_llm" ]; then
      step bundle_cosyvoice3 "$BUNDLE_TIMEOUT" bash "$repo_root/run_cosyvoice3.sh" 0 0
    fi ;;
  esac
fi

# --- 3: engine in-process -------------------------------------------------------------------------------
if wanted 3; then
  rm -f "$OUT/engine.json" "$OUT/frontend.md"
  if [ -n "$FRONTEND_BATCHES" ]; then
    step frontend "$FRONTEND_TIMEOUT" "$PY" "$repo_root/scripts/bench_frontend.py" \
      --model-dir "$MODELS_DIR/CosyVoice2-0.5B" --backends "$FRONTEND_BACKENDS" --batches "$FRONTEND_BATCHES" --out "$OUT/frontend.md"
    case " $ENGINE_MODELS " in *" cosyvoice3 "*)  # CosyVoice3's own speech tokenizer (v3)
      step frontend_v3 "$FRONTEND_TIMEOUT" "$PY" "$repo_root/scripts/bench_frontend.py" \
        --model-dir "$MODELS_DIR/Fun-CosyVoice3-0.5B-2512" --tokenizer speech_tokenizer_v3.onnx --backends "$FRONTEND_BACKENDS" \
        --batches "$FRONTEND_BATCHES" --out "$OUT/frontend_v3.md" ;;
    esac
  fi
  new_clip_args=()
  [ -z "$ENGINE_NEW_CLIPS" ] || new_clip_args=(--new-clips $ENGINE_NEW_CLIPS --new-clip-rounds "$ENGINE_NEW_CLIP_ROUNDS")
  [ -z "$ENGINE_NEW_CLIPS" ] || [ -z "$ENGINE_NEW_CLIPS_WHILE_PLAYING" ] || \
    new_clip_args+=(--new-clips-while-playing $ENGINE_NEW_CLIPS_WHILE_PLAYING)
  for model in $ENGINE_MODELS; do
  json=$OUT/engine.json
  [ "$model" = "$ENGINE_MODEL" ] || json=$OUT/engine_$model.json
  # shellcheck disable=SC2086
  # bench_engine.py in-process through campaign_report.py: the JSON is rewritten after every level
  step "engine_$model" "$ENGINE_TIMEOUT" "$PY" "$repo_root/scripts/campaign_report.py" engine "$json" -- \
    --models-dir "$MODELS_DIR" --model "$model" --device "$ENGINE_DEVICE" --tokens "$TOKENS" \
    --concurrency $ENGINE_CONCURRENCY --requests-per-sender "$ENGINE_REQUESTS_PER_SENDER" --rates $ENGINE_RATES \
    --seconds-per-rate "$ENGINE_SECONDS_PER_RATE" --profile-rate "$ENGINE_PROFILE_RATE" \
    --profile-seconds "$ENGINE_PROFILE_SECONDS" --sync-debug-rate "$ENGINE_SYNC_DEBUG_RATE" \
    "${new_clip_args[@]}" $ENGINE_EXTRA_ARGS
  done
fi

server_ready() { "$PY" - "$GRPC_PORT" <<'EOF' > /dev/null 2>&1
import sys
import tritonclient.grpc as g
sys.exit(0 if g.InferenceServerClient(f"127.0.0.1:{sys.argv[1]}").is_model_ready("cosyvoice2") else 1)
EOF
}

# --- 4: Triton + client_grpc.py -------------------------------------------------------------------------
if wanted 4; then
  server_touched=true
  rm -f "$OUT/triton_grpc.json" "$WORK"/grpc_*.json
  start=$SECONDS
  # the launcher's own wait ends first (it then stops the server it started), inside the budget left
  left=$((TOTAL_BUDGET_S - RESERVE_S - SECONDS))
  [ "$TRITON_START_TIMEOUT" -ge "$left" ] || left=$TRITON_START_TIMEOUT
  wait_s=$SERVER_START_TIMEOUT
  [ "$wait_s" -le $((left - 20)) ] || wait_s=$((left - 20))
  [ "$wait_s" -ge 1 ] || wait_s=1
  if step triton_start "$TRITON_START_TIMEOUT" env API_PORT= SERVER_START_TIMEOUT="$wait_s" \
       bash "$repo_root/run.sh" 2 3; then
    echo "triton_ready_s=$((SECONDS - start))" > "$WORK/triton_ready.txt"
  else
    tail_log "$SERVER_LOG"
  fi
  if server_ready; then
    level_files=()
    for level in $GRPC_LEVELS; do
      tasks=${level%%:*} requests=${level##*:}
      file=$WORK/grpc_${tasks}x${requests}.json
      step "grpc_${tasks}" "$GRPC_LEVEL_TIMEOUT" "$PY" "$repo_root/client_grpc.py" --server-addr 127.0.0.1 \
        --server-port "$GRPC_PORT" --model-name cosyvoice2 --mode streaming \
        --reference-audio "$MODELS_DIR/assets/prompt_audio.wav" --reference-text x \
        --target-text "$GRPC_TARGET_TEXT" --speaker-id "$SPEAKER_ID" --use-spk2info-cache True --log-interval 0 \
        --num-tasks "$tasks" --num-requests "$requests" --request-timeout "$GRPC_REQUEST_TIMEOUT" \
        --log-dir "$WORK/grpc_${tasks}" --json-report "$file" || tail_log "$SERVER_LOG"
      [ -f "$file" ] && level_files+=("$tasks concurrent=$file")
    done
    [ ${#level_files[@]} -eq 0 ] || "$PY" "$repo_root/scripts/campaign_report.py" merge "$OUT/triton_grpc.json" \
      --extra "$WORK/triton_ready.txt" "${level_files[@]}"
  else
    record grpc "not run: Triton's cosyvoice2 is not ready on port $GRPC_PORT"
  fi
fi

# --- 5: the API + bench_api.py --------------------------------------------------------------------------
if wanted 5; then
  server_touched=true
  rm -f "$OUT/api.json" "$WORK"/api_*.json
  if server_ready; then
    if step api_start "$API_START_TIMEOUT" "$PY" -m cosyserve.api.service start --pid-file "$API_PID_FILE" \
         --log "$API_LOG" --timeout "$((API_START_TIMEOUT - 10))" -- --port "$API_PORT" \
         --triton-url "127.0.0.1:$GRPC_PORT" --model-dir "$MODELS_DIR/CosyVoice2-0.5B" \
         --tokenizer-dir "$MODELS_DIR/cosyvoice2_llm"; then
      if [ "$UPLOAD_ROUNDS" -gt 0 ]; then  # on the idle server, before the load
        step api_voice_upload "$UPLOAD_TIMEOUT" "$PY" "$repo_root/scripts/bench_voice_upload.py" \
          --url "http://127.0.0.1:$API_PORT" --rounds "$UPLOAD_ROUNDS" --seconds "$UPLOAD_SECONDS" \
          --metrics "127.0.0.1:${METRICS_PORT:-8002}" --json "$OUT/voice_upload.json" || tail_log "$API_LOG"
      fi
      count=(--seconds-per-rate "$API_SECONDS_PER_RATE")
      [ -z "$API_REQUESTS_PER_RATE" ] || count=(--requests-per-rate "$API_REQUESTS_PER_RATE")
      for lang in $API_LANGS; do
        case "$lang" in
          en) printf '%s\n' "$API_TEXTS_EN" > "$WORK/texts_$lang.txt" ;;
          zh) printf '%s\n' "$API_TEXTS_ZH" > "$WORK/texts_$lang.txt" ;;
          *) log "no texts for API language $lang (en, zh): left out" ;;
        esac
      done
      # rate by rate, the languages in turn: a budget that runs out leaves both at the lower rates
      lang_files=()
      for rate in $API_RATES; do
        for lang in $API_LANGS; do
          [ -f "$WORK/texts_$lang.txt" ] || continue
          file=$WORK/api_${lang}_$rate.json
          step "api_${lang}_$rate" "$API_RATE_TIMEOUT" "$PY" "$repo_root/scripts/bench_api.py" \
            --url "http://127.0.0.1:$API_PORT" --rates "$rate" "${count[@]}" --texts "$WORK/texts_$lang.txt" \
            --timeout "$API_REQUEST_TIMEOUT" --json-report "$file" --metrics "127.0.0.1:${METRICS_PORT:-8002}" \
            || { tail_log "$API_LOG"; tail_log "$SERVER_LOG"; }
          [ -f "$file" ] && lang_files+=("$lang=$file")
        done
      done
      [ ${#lang_files[@]} -eq 0 ] || "$PY" "$repo_root/scripts/campaign_report.py" merge "$OUT/api.json" "${lang_files[@]}"
      if [ -n "$SOCKET_LEVELS" ]; then
        # shellcheck disable=SC2086
        step api_sockets "$SOCKET_TIMEOUT" "$PY" "$repo_root/scripts/bench_text_socket.py" \
          --url "http://127.0.0.1:$API_PORT" --sockets $SOCKET_LEVELS --chars-per-s "$SOCKET_CHARS_PER_S" \
          --json "$OUT/sockets.json" || tail_log "$API_LOG"
      fi
    else
      tail_log "$API_LOG"
    fi
  else
    record api "not run: Triton's cosyvoice2 is not ready on port $GRPC_PORT"
  fi
fi

# --- 6: stop --------------------------------------------------------------------------------------------
if wanted 6; then
  server_touched=true
  stop_servers
fi

# --- 7: report ------------------------------------------------------------------------------------------
if wanted 7; then
  log "Stage 7: report"
  "$PY" "$repo_root/scripts/campaign_report.py" report --out-dir "$OUT" --stages "$STATUS_FILE" \
    --env "$WORK/env.txt" --write "$OUT/report.md" || log "the report failed"
fi

log "gpu_campaign done after $SECONDS s: $failures failed or skipped step(s); files: $(find "$OUT" -maxdepth 1 -type f -printf '%f ')"
[ "$failures" -eq 0 ]
