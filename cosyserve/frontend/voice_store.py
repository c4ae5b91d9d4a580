"""Voices uploaded through the HTTP API, kept on disk and shared by every process that serves them.

One directory per voice under the store's root, created complete or not at all (written in a
hidden temporary directory, fsynced, then renamed into place)::

    <root>/<voice id>/
        voice.json    {"id", "name", "created_at", "transcript"}  (transcript null = cross-lingual)
        audio.wav     the validated reference clip, mono float32 at 16 kHz
        features.pt   its prompt features for CosyVoice2, written by the first server process that
                      needs them (features.cosyvoice3.pt for CosyVoice3: a voice serves both models,
                      each with features of its own front-end)

The API process writes voice.json and audio.wav; the Triton front door reads them by voice id and
computes the features (speech tokens, mel, speaker embedding) once, then every instance reads
them. Deleting renames the directory away first, so a voice disappears at once.
Ids are made here (``voice_`` + 32 hex digits) and every id given from outside is checked
against that form before it touches a path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from ..audio.io import TOKENIZER_SAMPLE_RATE
from ..errors import InvalidInputError
from .prompt import PromptFeatures

VOICES_DIR = "voices"  # the store's default place, in the CosyVoice2 model directory next to spk2info.pt
FEATURES_FILE = "features.pt"  # CosyVoice2's
COSYVOICE3_FEATURES_FILE = "features.cosyvoice3.pt"  # CosyVoice3's, next to CosyVoice2's of the same voice
VOICE_ID = re.compile(r"voice_[0-9a-f]{32}")
MAX_NAME_CHARS = 200


class UnknownVoiceError(InvalidInputError):
    """No voice has this id (never created, or deleted)."""


@dataclass(frozen=True)
class StoredVoice:
    id: str
    name: str
    created_at: int  # Unix seconds
    transcript: str | None  # None: no transcript, the voice is used cross-lingually


def is_voice_id(text: str) -> bool:
    return bool(VOICE_ID.fullmatch(text))


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (the directory entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class VoiceStore:
    def __init__(self, root: str | Path, features_file: str = FEATURES_FILE):
        self.root = Path(root)
        self.features_file = features_file

    def _dir(self, voice_id: str) -> Path:
        if not isinstance(voice_id, str) or not is_voice_id(voice_id):
            raise UnknownVoiceError(f"unknown voice {voice_id!r}: voice ids look like voice_<32 hex digits>")
        return self.root / voice_id

    def create(self, name: str, wav16: np.ndarray, transcript: str | None) -> StoredVoice:
        """Store a validated 16 kHz mono clip as a new voice."""
        if not name.strip() or len(name) > MAX_NAME_CHARS:
            raise InvalidInputError(f"voice name must have 1 to {MAX_NAME_CHARS} characters, got {len(name)}")
        voice = StoredVoice(f"voice_{uuid.uuid4().hex}", name, int(time.time()),
                            transcript if transcript and transcript.strip() else None)
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{voice.id}.", dir=self.root))
        try:
            sf.write(staging / "audio.wav", np.asarray(wav16, np.float32), TOKENIZER_SAMPLE_RATE, subtype="FLOAT")
            with open(staging / "audio.wav", "rb+") as file:
                os.fsync(file.fileno())
            _fsync_write(staging / "voice.json", json.dumps(asdict(voice), ensure_ascii=False).encode())
            staging.chmod(0o755)  # mkdtemp makes 0700; Triton may run as another user
            os.rename(staging, self.root / voice.id)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return voice

    def get(self, voice_id: str) -> StoredVoice:
        try:
            meta = json.loads((self._dir(voice_id) / "voice.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UnknownVoiceError(f"unknown voice {voice_id!r}: no such voice (deleted, or never created)") from None
        return StoredVoice(**meta)

    def __contains__(self, voice_id: object) -> bool:
        return isinstance(voice_id, str) and is_voice_id(voice_id) and (self.root / voice_id / "voice.json").exists()

    def list(self) -> list[StoredVoice]:
        if not self.root.is_dir():
            return []
        voices = []
        for path in self.root.iterdir():
            if is_voice_id(path.name):
                try:
                    voices.append(self.get(path.name))
                except UnknownVoiceError:  # deleted meanwhile
                    pass
        return sorted(voices, key=lambda v: (v.created_at, v.id))

    def delete(self, voice_id: str) -> None:
        path = self._dir(voice_id)
        trash = self.root / f".deleted.{voice_id}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            raise UnknownVoiceError(f"unknown voice {voice_id!r}: no such voice (deleted, or never created)") from None
        _fsync_dir(self.root)
        shutil.rmtree(trash, ignore_errors=True)

    def audio16(self, voice_id: str) -> np.ndarray:
        try:
            wav, rate = sf.read(self._dir(voice_id) / "audio.wav", dtype="float32")
        except (FileNotFoundError, sf.LibsndfileError):
            raise UnknownVoiceError(f"unknown voice {voice_id!r}: no such voice (deleted, or never created)") from None
        assert rate == TOKENIZER_SAMPLE_RATE, f"{voice_id}: stored at {rate} Hz"
        return wav

    def load_features(self, voice_id: str) -> PromptFeatures | None:
        """The voice's features if a server process has computed them, else None."""
        try:
            saved = torch.load(self._dir(voice_id) / self.features_file, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            return None
        return PromptFeatures(speech_tokens=saved["speech_tokens"], speech_feat=saved["speech_feat"],
                              embedding=saved["embedding"])

    def save_features(self, voice_id: str, features: PromptFeatures) -> None:
        """Write the features file atomically; raises UnknownVoiceError when the voice was deleted meanwhile."""
        directory = self._dir(voice_id)
        saved = {"speech_tokens": features.speech_tokens, "speech_feat": features.speech_feat,
                 "embedding": features.embedding}
        try:
            fd, tmp_name = tempfile.mkstemp(prefix=".features.", suffix=".tmp", dir=directory)
        except FileNotFoundError:
            raise UnknownVoiceError(f"unknown voice {voice_id!r}: deleted while in use") from None
        try:
            with os.fdopen(fd, "wb") as file:
                torch.save(saved, file)
                file.flush()
                os.fsync(file.fileno())
            os.chmod(tmp_name, 0o644)
            os.replace(tmp_name, directory / self.features_file)
        except FileNotFoundError:
            Path(tmp_name).unlink(missing_ok=True)
            raise UnknownVoiceError(f"unknown voice {voice_id!r}: deleted while in use") from None
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
