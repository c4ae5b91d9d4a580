"""The voices the API offers: the built-in ones of spk2info.pt and those uploaded into the
:class:`~cosyserve.frontend.voice_store.VoiceStore` that the Triton front door reads by id."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile as sf

from ..audio.io import prompt_audio_from_array
from ..errors import InvalidInputError
from ..frontend.speakers import SpeakerRegistry
from ..frontend.voice_store import StoredVoice, UnknownVoiceError, VoiceStore
from ..engine.front_end import DEFAULT_SPEAKER

# OpenAI's voice names: clients hard-code them, so they select the default speaker here.
OPENAI_VOICE_NAMES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                      "marin", "cedar")


def decode_upload(data: bytes) -> tuple[np.ndarray, int]:
    """An uploaded audio file -> mono float32 samples and their rate: WAV, FLAC and Ogg through
    libsndfile (soundfile: a 10 s WAV in about a millisecond), any other format FFmpeg reads through
    PyAV."""
    try:
        wav, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError):
        return _decode_with_ffmpeg(data)
    if wav.size == 0:
        raise InvalidInputError("audio_sample holds no audio")
    return wav.mean(axis=1).astype(np.float32), int(rate)


def _decode_with_ffmpeg(data: bytes) -> tuple[np.ndarray, int]:
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.audio:
                raise InvalidInputError("audio_sample has no audio stream")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=stream.rate)
            pieces = [out.to_ndarray().reshape(-1) for frame in container.decode(stream)
                      for out in resampler.resample(frame)]
            rate = stream.rate
    except av.FFmpegError as exc:
        raise InvalidInputError(f"audio_sample is not a readable audio file ({exc})") from None
    if not pieces:
        raise InvalidInputError("audio_sample holds no audio")
    return np.concatenate(pieces).astype(np.float32), int(rate)


def prompt_wav16(data: bytes) -> np.ndarray:
    """The upload checked with the server's prompt rules (rate >= 16 kHz, 0.5-30 s, finite, not
    silent) and resampled to the 16 kHz that the voice store keeps."""
    wav, rate = decode_upload(data)
    return prompt_audio_from_array(wav, rate).wav16.numpy()


def voice_object(voice_id: str, name: str, created_at: int, kind: str) -> dict:
    """OpenAI's ``audio.voice`` object; ``kind``: builtin | zero_shot | cross_lingual (this server's)."""
    return {"object": "audio.voice", "id": voice_id, "name": name, "created_at": created_at, "kind": kind}


def stored_voice_object(voice: StoredVoice) -> dict:
    return voice_object(voice.id, voice.name, voice.created_at,
                        "cross_lingual" if voice.transcript is None else "zero_shot")


class VoiceCatalog:
    """``spk2info`` None: a model without built-in voices (CosyVoice3): only stored voices, and
    OpenAI's voice names have no default speaker to stand for."""

    def __init__(self, spk2info: Path | None, store: VoiceStore):
        self.builtin = SpeakerRegistry.load(spk2info).ids() if spk2info is not None else []
        self.store = store

    def speaker_id(self, voice: str) -> str:
        """The front door's ``speaker_id`` for a request's voice; raises UnknownVoiceError."""
        if voice in OPENAI_VOICE_NAMES and self.builtin:
            return DEFAULT_SPEAKER
        if voice in self.builtin or voice in self.store:
            return voice
        if not self.builtin:
            raise UnknownVoiceError(f"unknown voice {voice!r}: this model has no built-in voices; use one created "
                                    "with POST /v1/audio/voices")
        raise UnknownVoiceError(
            f"unknown voice {voice!r}: use a built-in voice ({', '.join(self.builtin[:5])}...), one created with "
            "POST /v1/audio/voices, or an OpenAI voice name (the default speaker)")

    def get(self, voice_id: str) -> dict:
        if voice_id in self.builtin:
            return voice_object(voice_id, voice_id, 0, "builtin")
        return stored_voice_object(self.store.get(voice_id))

    def list(self) -> list[dict]:
        return ([voice_object(v, v, 0, "builtin") for v in self.builtin]
                + [stored_voice_object(v) for v in self.store.list()])

    def delete(self, voice_id: str) -> None:
        if voice_id in self.builtin:
            raise InvalidInputError(f"voice {voice_id!r} is built in (spk2info.pt) and cannot be deleted")
        self.store.delete(voice_id)


