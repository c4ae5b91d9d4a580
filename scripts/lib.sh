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
