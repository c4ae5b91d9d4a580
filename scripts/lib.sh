# Shell helpers of run.sh and run_stepaudio2_dit_token2wav.sh (sourced, not run).

# log MESSAGE...: time-stamped, with the calling script, line and function
log() {
  local fname=${BASH_SOURCE[1]##*/}
  echo -e "$(date '+%Y-%m-%d %H:%M:%S') (${fname}:${BASH_LINENO[0]}:${FUNCNAME[1]}) $*"
}

die() {
  local fname=${BASH_SOURCE[1]##*/}
  echo -e "$(date '+%Y-%m-%d %H:%M:%S') (${fname}:${BASH_LINENO[0]}:${FUNCNAME[1]}) ERROR: $*"
  exit 1
}

# parse_stages WORDS ARGS...: sets stage and stop_stage from ARGS, "<stage> [<stop_stage>]" or,
# icefall-style, "--stage N [--stop-stage M]" (also --stage=N, --stop_stage M). The stop stage
# defaults to the start stage; no argument at all is stage 0. A stage is an integer or one of the
# space-separated WORDS the script handles itself (e.g. "stop wait"), which take no stop stage.
parse_stages() {
  local words=" $1 " positional=() value
  shift
  stage=
  stop_stage=
  while [ $# -gt 0 ]; do
    case "$1" in
      --stage=*|--stop-stage=*|--stop_stage=*) value=${1#*=} ;;
      --stage|--stop-stage|--stop_stage) [ $# -ge 2 ] || die "$1 needs a value"; value=$2 ;;
      *) positional+=("$1"); shift; continue ;;
    esac
    case "$1" in
      --stage*) stage=$value ;;
      *) stop_stage=$value ;;
    esac
    case "$1" in *=*) shift ;; *) shift 2 ;; esac
  done
  [ ${#positional[@]} -le 2 ] || die "expected <stage> [<stop_stage>], got: ${positional[*]}"
  if [ ${#positional[@]} -ge 1 ]; then
    [ -z "$stage" ] || die "the stage is given twice (--stage $stage and ${positional[0]})"
    stage=${positional[0]}
    [ ${#positional[@]} -lt 2 ] || stop_stage=${positional[1]}
  fi
  stage=${stage:-0}
  stop_stage=${stop_stage:-$stage}
  if [[ "$words" == *" $stage "* ]]; then
    [ "$stop_stage" = "$stage" ] || die "stage $stage takes no stop stage"
    return 0
  fi
  [[ "$stage" =~ ^-?[0-9]+$ ]] || die "the stage must be an integer or one of:$words got '$stage'"
  [[ "$stop_stage" =~ ^-?[0-9]+$ ]] || die "the stop stage must be an integer, got '$stop_stage'"
}

# use_venv: put $VENV/bin first on PATH (when it exists) and set PY to its python
use_venv() {
  if [ -x "$VENV/bin/python" ]; then
    export PATH="$VENV/bin:$PATH"
  fi
  PY=$(command -v python || command -v python3)
}

# data_args MANIFEST_FILE: the client's data options: MANIFEST, else DATASET (split SPLIT_NAME
# when set), else MANIFEST_FILE (see write_prompt_manifest)
data_args() {
  if [ -n "$MANIFEST" ]; then echo "--manifest-path $MANIFEST";
  elif [ -n "$DATASET" ]; then echo "--huggingface-dataset $DATASET${SPLIT_NAME:+ --split-name $SPLIT_NAME}";
  else echo "--manifest-path $1"; fi
}

# write_prompt_manifest FILE: without a dataset, NUM_TASKS utterances of TARGET_TEXT on the bundled
# prompt (works offline, e.g. with MODEL_SOURCE=tiny)
write_prompt_manifest() {
  local wav="$MODELS_DIR/assets/prompt_audio.wav" text i
  [ -f "$wav" ] || die "no MANIFEST/DATASET given and $wav does not exist (MODEL_SOURCE=tiny|real stage 0 writes it)"
  text=$(cat "$MODELS_DIR/assets/prompt_text.txt")
  : > "$1"
  for i in $(seq 1 "$NUM_TASKS"); do
    echo "utt$i|$text|$wav|$TARGET_TEXT" >> "$1"
  done
}

# wait_http_ready URL PID WHAT LOG: poll URL until it answers 200; fail early if process PID exits,
# or after SERVER_START_TIMEOUT seconds (the log's tail is shown either way)
wait_http_ready() {
  local url=$1 pid=$2 what=$3 logfile=$4 deadline=$((SECONDS + SERVER_START_TIMEOUT))
  until "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$url" 2> /dev/null; do
    if ! kill -0 "$pid" 2> /dev/null; then tail -n 30 "$logfile" >&2; die "$what exited before it was ready (log: $logfile)"; fi
    [ "$SECONDS" -lt "$deadline" ] || { tail -n 30 "$logfile" >&2; die "$what was not ready after $SERVER_START_TIMEOUT s (log: $logfile)"; }
    sleep 0.5
  done
}

# start_llm_server_process PID_FILE LOG PORT CMD...: an OpenAI-compatible LLM server (CMD) in its own
# session (so that stop_llm_server_process can signal its whole process group), its pid in PID_FILE;
# returns once http://127.0.0.1:PORT/health answers. One already running from PID_FILE is kept.
start_llm_server_process() {
  local pid_file=$1 logfile=$2 port=$3 running
  shift 3
  running=$(cat "$pid_file" 2> /dev/null || true)
  if [ -n "$running" ] && kill -0 "$running" 2> /dev/null; then
    log "the LLM server from $pid_file is already running (pid $running): using it"
    return 0
  fi
  mkdir -p "$(dirname "$logfile")" "$(dirname "$pid_file")"
  log "starting the LLM server on port $port, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-all} (log: $logfile)"
  setsid "$@" > "$logfile" 2>&1 < /dev/null &
  echo $! > "$pid_file"
  wait_http_ready "http://127.0.0.1:$port/health" "$(cat "$pid_file")" "the LLM server" "$logfile"
  log "LLM server ready on port $port"
}

# stop_llm_server_process PID_FILE: end the LLM server started from PID_FILE (its whole process group:
# trtllm-serve has workers of its own)
stop_llm_server_process() {
  stop_pid_file "$1" "the LLM server" is_llm_server group
}

# --- stopping from pid files: bash alone, so that `stop` works without the project's venv -------------

# process_running PID: whether PID exists and is not a zombie (a server that has exited but whose
# parent has not reaped it yet counts as stopped)
process_running() {
  local stat
  stat=$(cat "/proc/$1/stat" 2> /dev/null) || return 1
  stat=${stat##*) }  # the state follows the command name, which may hold spaces and parentheses
  case "${stat%% *}" in Z|X) return 1 ;; *) return 0 ;; esac
}

# process_args PID: its command line, one argument a line (empty once it is gone)
process_args() {
  tr '\0' '\n' < "/proc/$1/cmdline" 2> /dev/null || true
}

# is_tritonserver / is_api / is_llm_server PID: whether the process of a pid file is still what the
# file was written for, since its pid may have been reused by anything else since
is_tritonserver() {
  local args
  args=$(process_args "$1")
  [[ "${args%%$'\n'*}" =~ (^|/)tritonserver$ ]]
}
is_api() {
  grep -qx 'cosyserve.api' <<< "$(process_args "$1")"
}
is_llm_server() {
  grep -qE 'cosyserve\.llm\.openai_server|trtllm-serve' <<< "$(process_args "$1")"
}

# stop_pid_file PID_FILE NAME IS_EXPECTED [group]: stop the NAME process recorded in PID_FILE and remove
# the file. Only a process that IS_EXPECTED accepts is signalled (else an error and status 1). SIGTERM
# goes to the process (with "group": to its process group), and after STOP_TIMEOUT_S seconds (45:
# Triton waits up to 30 s for requests in flight) SIGKILL to its process group, which also holds
# Triton's stubs: every process this file stops was started in a session of its own.
stop_pid_file() {
  local pid_file=$1 name=$2 is_expected=$3 target pid deadline
  pid=$(cat "$pid_file" 2> /dev/null || true)
  if [ -z "$pid" ]; then log "no pid file $pid_file: nothing to stop"; return 0; fi
  [[ "$pid" =~ ^[0-9]+$ ]] || { echo "error: pid file $pid_file does not hold a process id: '$pid'" >&2; return 1; }
  if ! process_running "$pid"; then
    rm -f "$pid_file"
    log "$name (pid $pid) was not running; removed $pid_file"
    return 0
  fi
  "$is_expected" "$pid" || { echo "error: pid $pid from $pid_file is not a $name process; not stopping it" >&2; return 1; }
  target=$pid
  [ "${4:-}" != group ] || target=-$pid
  kill -TERM -- "$target" 2> /dev/null || true
  deadline=$((SECONDS + ${STOP_TIMEOUT_S:-45}))
  while process_running "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
  if process_running "$pid"; then
    kill -KILL -- "-$pid" 2> /dev/null || kill -KILL -- "$pid" 2> /dev/null || true
    deadline=$((SECONDS + 10))
    while process_running "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
  fi
  if process_running "$pid"; then echo "error: $name (pid $pid) is still running after SIGKILL" >&2; return 1; fi
  rm -f "$pid_file"
  log "stopped $name (pid $pid)"
}
