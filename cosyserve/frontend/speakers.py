"""Cached speakers, stored in the ``spk2info.pt`` format of the released CosyVoice2 runtimes.

File layout (``torch.save`` of a plain dict, loadable with ``weights_only=True``), as read by
the Triton ``cosyvoice2``/``token2wav`` models (``spk2info["001"]``) and as written by the
async_cosyvoice ``spk2info.pt`` that their ``run.sh`` downloads::

    {speaker_id: {
        "speech_token": int32 (1, P),        # S3 tokens of the prompt, ids 0..6560
        "speech_feat":  float32 (1, 2P, 80), # 24 kHz prompt mel, time-major
        "embedding":    float32 (1, 192),    # raw CAM++ x-vector
        "prompt_text":  str,                 # transcript of the prompt (LLM prefix)
        ...                                  # any other keys ("spk_id", "name",
    }}                                       #  "prompt_text_token", ...) are kept as they are

``speech_token``, ``speech_feat`` and ``embedding`` are required; ``prompt_text`` defaults to
"" (then the LLM prompt carries no transcript). Entries written here carry ``spk_id`` too.
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..audio.io import PromptAudio
from ..errors import InvalidInputError, ModelLoadError
from .onnx_models import SPEAKER_EMBEDDING_DIM, SpeakerEncoder, SpeechTokenizer
from .prompt import TOKEN_MEL_RATIO, PromptFeatures, build_prompt_features

REQUIRED_KEYS = ("speech_token", "speech_feat", "embedding")
MEL_BINS = 80


@dataclass(frozen=True)
class Speaker:
    """A cached speaker as the pipeline uses it; its tensors are shared, treat them as read-only."""

    speaker_id: str
    prompt_text: str
    features: PromptFeatures


def _parse_entry(speaker_id: str, entry: Any) -> Speaker:
    """Validate one spk2info entry and convert it to unbatched tensors; raises ModelLoadError."""
    if not isinstance(entry, dict):
        raise ModelLoadError(f"speaker {speaker_id!r}: entry is a {type(entry).__name__}, expected a dict")
    missing = [key for key in REQUIRED_KEYS if not isinstance(entry.get(key), torch.Tensor)]
    if missing:
        raise ModelLoadError(f"speaker {speaker_id!r}: missing tensor(s) {missing}; "
                             f"an entry needs {list(REQUIRED_KEYS)}")
    tokens = entry["speech_token"].reshape(-1).to(torch.int32)
    feat = entry["speech_feat"]
    feat = feat[0] if feat.dim() == 3 and feat.shape[0] == 1 else feat
    embedding = entry["embedding"].reshape(-1).to(torch.float32)
    if feat.dim() != 2 or feat.shape[1] != MEL_BINS or feat.shape[0] != TOKEN_MEL_RATIO * tokens.numel():
        raise ModelLoadError(f"speaker {speaker_id!r}: speech_feat has shape {tuple(entry['speech_feat'].shape)}; "
                             f"expected (1, {TOKEN_MEL_RATIO * tokens.numel()}, {MEL_BINS}) for "
                             f"{tokens.numel()} speech tokens")
    if embedding.numel() != SPEAKER_EMBEDDING_DIM:
        raise ModelLoadError(f"speaker {speaker_id!r}: embedding has {embedding.numel()} values, "
                             f"expected {SPEAKER_EMBEDDING_DIM}")
    prompt_text = entry.get("prompt_text", "")
    if not isinstance(prompt_text, str):
        raise ModelLoadError(f"speaker {speaker_id!r}: prompt_text is a {type(prompt_text).__name__}, expected str")
    features = PromptFeatures(speech_tokens=tokens, speech_feat=feat.to(torch.float32), embedding=embedding)
    return Speaker(speaker_id, prompt_text, features)


class SpeakerRegistry:
    """Thread-safe map speaker id -> :class:`Speaker`, persisted as ``spk2info.pt``."""

    def __init__(self, spk2info: dict[str, dict] | None = None, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self._lock = threading.RLock()
        self._entries: dict[str, dict] = {}  # as stored in the file, extra keys included
        self._speakers: dict[str, Speaker] = {}
        for speaker_id, entry in (spk2info or {}).items():
            self._speakers[str(speaker_id)] = _parse_entry(str(speaker_id), entry)
            self._entries[str(speaker_id)] = dict(entry)

    @classmethod
    def load(cls, path: str | Path) -> SpeakerRegistry:
        path = Path(path)
        try:
            spk2info = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError as exc:
            raise ModelLoadError(f"speaker file {path} does not exist") from exc
        except Exception as exc:  # pickle / zip errors have no common base class
            raise ModelLoadError(f"cannot read speaker file {path}: {exc}") from exc
        if not isinstance(spk2info, dict):
            raise ModelLoadError(f"{path} holds a {type(spk2info).__name__}; spk2info.pt must be a dict of speakers")
        return cls(spk2info, path=path)

    def __len__(self) -> int:
        return len(self._speakers)

    def __contains__(self, speaker_id: object) -> bool:
        return speaker_id in self._speakers

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._speakers)

    def get(self, speaker_id: str) -> Speaker:
        with self._lock:
            speaker = self._speakers.get(speaker_id)
            if speaker is None:
                known = list(self._speakers)
                examples = f" (e.g. {', '.join(repr(k) for k in known[:5])})" if known else ""
                raise InvalidInputError(
                    f"unknown speaker id {speaker_id!r}: {len(known)} speakers are registered{examples}")
            return speaker

    def add(self, speaker_id: str, features: PromptFeatures, *, prompt_text: str = "") -> Speaker:
        """Add or replace a speaker from computed prompt features."""
        if not isinstance(speaker_id, str) or not speaker_id.strip():
            raise InvalidInputError(f"speaker id must be a non-empty string, got {speaker_id!r}")
        entry = {
            "spk_id": speaker_id,
            "prompt_text": prompt_text,
            "speech_token": features.speech_tokens.detach().cpu().to(torch.int32).reshape(1, -1),
            "speech_feat": features.speech_feat.detach().cpu().to(torch.float32).unsqueeze(0),
            "embedding": features.embedding.detach().cpu().to(torch.float32).reshape(1, -1),
        }
        speaker = _parse_entry(speaker_id, entry)
        with self._lock:
            self._entries[speaker_id] = entry
            self._speakers[speaker_id] = speaker
        return speaker

    def register(self, speaker_id: str, prompt_audio: PromptAudio, prompt_text: str,
                 tokenizer: SpeechTokenizer, speaker_encoder: SpeakerEncoder) -> Speaker:
        """Compute a reference clip's features (tokens, mel, embedding) and add the speaker."""
        features = build_prompt_features(prompt_audio, tokenizer, speaker_encoder)
        return self.add(speaker_id, features, prompt_text=prompt_text)

    def remove(self, speaker_id: str) -> None:
        with self._lock:
            self.get(speaker_id)  # raises the usual error for unknown ids
            del self._entries[speaker_id], self._speakers[speaker_id]

    def to_spk2info(self) -> dict[str, dict]:
        """A snapshot in the file layout (new dicts, shared tensors)."""
        with self._lock:
            return {speaker_id: dict(entry) for speaker_id, entry in self._entries.items()}

    def save(self, path: str | Path | None = None) -> Path:
        """Write ``spk2info.pt`` atomically (temp file in the same directory, fsync, rename)."""
        target = Path(path) if path is not None else self.path
        if target is None:
            raise ValueError("no path given and the registry was not loaded from a file")
        target.parent.mkdir(parents=True, exist_ok=True)
        snapshot = self.to_spk2info()
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as tmp_file:
                torch.save(snapshot, tmp_file)
                tmp_file.flush()
                os.fsync(tmp_file.fileno())
            os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; the file is shared model data
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        return target
