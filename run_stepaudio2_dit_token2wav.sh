#!/usr/bin/env bash
# CosyVoice2 with the Step-Audio-2-mini DiT token2wav (the "cosyvoice2_dit" pipeline).
#   bash run_stepaudio2_dit_token2wav.sh <start_stage> <stop_stage>
# Status: the DiT flow model and its parity checks are in cosyserve.models.dit; the serving
# stages of this script (model repository, LLM server + Triton, benchmarks, disaggregated
# launch) are not implemented yet and fail with a clear message instead of pretending.
set -euo pipefail
stage=${1:-0}
stop_stage=${2:-${1:-0}}
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=${VENV:-$repo_root/.venv}
MODEL_SOURCE=${MODEL_SOURCE:-huggingface}
MODELS_DIR=${MODELS_DIR:-$repo_root/models}
BUNDLE_SEED=${BUNDLE_SEED:-0}

log() { echo -e "$(date '+%Y-%m-%d %H:%M:%S') (${BASH_SOURCE[1]##*/}:${BASH_LINENO[0]}) $*"; }
die() { log "ERROR: $*"; exit 1; }
[ -x "$VENV/bin/python" ] && export PATH="$VENV/bin:$PATH"

if [ "$stage" -le -1 ] && [ "$stop_stage" -ge -1 ]; then
  log "Stage -1: Python environment (shared with run.sh)"
  VENV=$VENV bash "$repo_root/run.sh" -1 -1
fi

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  case "$MODEL_SOURCE" in
    tiny|real)
      log "Stage 0: generating a $MODEL_SOURCE random-weight bundle with the DiT token2wav"
      python "$repo_root/scripts/make_model_bundle.py" --size "$MODEL_SOURCE" --seed "$BUNDLE_SEED" \
        --out "$MODELS_DIR" --parts cosyvoice2,llm,dit
      ;;
    *) die "Stage 0: downloading Step-Audio-2-mini is not implemented yet; use MODEL_SOURCE=tiny|real" ;;
  esac
fi

if [ "$stop_stage" -ge 1 ]; then
  die "Stages 1-8 of the DiT pipeline (LLM server, cosyvoice2_dit/token2wav_dit Triton models, benchmarks, disaggregated serving) are not implemented yet"
fi
