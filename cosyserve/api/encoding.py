"""Streaming audio encoders for the speech endpoint: float32 24 kHz chunks in, encoded bytes out.

Every encoder returns the bytes ready after each chunk, so a response can be sent while the
audio is still being generated:

* ``pcm``: 16-bit little-endian mono samples, nothing else (OpenAI's raw format);
* ``wav``: a RIFF header whose size fields are 0xFFFFFFFF (length unknown while streaming, as
  streaming WAV writers do), then the same PCM;
* ``mp3``, ``opus`` (in Ogg), ``aac`` (ADTS), ``flac``: PyAV (FFmpeg) encoders and muxers
  writing into a buffer that is drained after every chunk. The Ogg muxer is told to close a page
  every 20 ms instead of buffering a second of audio.

The text-in WebSockets take ElevenLabs' ``output_format`` names instead
(:func:`output_format_encoder`): ``pcm_<rate>`` (16-bit little-endian at that rate), ``ulaw_8000``
(G.711 mu-law, telephony) and ``mp3_<rate>_<kbps>``, resampled from 24 kHz by FFmpeg's resampler,
which keeps its state across chunks.
"""

from __future__ import annotations

import re
import struct

import numpy as np

from ..errors import InvalidInputError
from ..schedule import OUTPUT_SAMPLE_RATE

# response_format -> (FFmpeg muxer, encoder, muxer options); pcm and wav are written here.
PYAV_FORMATS = {
    "mp3": ("mp3", "libmp3lame", {}),
    "opus": ("ogg", "libopus", {"page_duration": "20000"}),
    "aac": ("adts", "aac", {}),
    "flac": ("flac", "flac", {}),
}
MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
               "wav": "audio/wav", "pcm": "audio/pcm"}
UNKNOWN_SIZE = 0xFFFFFFFF


def pcm16(chunk: np.ndarray) -> bytes:
    return (np.clip(chunk, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def streaming_wav_header(sample_rate: int = OUTPUT_SAMPLE_RATE) -> bytes:
    """A 44-byte PCM s16le mono header with unknown (0xFFFFFFFF) RIFF and data sizes."""
    return (b"RIFF" + struct.pack("<I", UNKNOWN_SIZE) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", UNKNOWN_SIZE))


class PCMEncoder:
    def __init__(self, header: bytes = b""):
        self._header = header

    def encode(self, chunk: np.ndarray) -> bytes:
        data, self._header = self._header + pcm16(chunk), b""
        return data

    def finish(self) -> bytes:
        return self._header  # the header alone when no audio came


class _Buffer:
    """The file object PyAV muxes into (write-only, not seekable: a stream)."""

    def __init__(self):
        self.data = bytearray()

    def write(self, data) -> int:
        self.data += data
        return len(data)

    def take(self) -> bytes:
        out, self.data = bytes(self.data), bytearray()
        return out


def audio_frame(chunk: np.ndarray):
    """A float32 24 kHz chunk as a PyAV frame."""
    import av

    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(chunk, np.float32)[None], format="flt", layout="mono")
    frame.sample_rate = OUTPUT_SAMPLE_RATE
    return frame


class PyAVEncoder:
    """``response_format``'s encoder and muxer; at ``sample_rate`` (the input resampled from 24 kHz
    when it differs) and ``bit_rate`` (bits/s; the codec's default if None)."""

    def __init__(self, response_format: str, sample_rate: int = OUTPUT_SAMPLE_RATE, bit_rate: int | None = None):
        import av

        muxer, codec, options = PYAV_FORMATS[response_format]
        self._buffer = _Buffer()
        self._container = av.open(self._buffer, mode="w", format=muxer, options=options)
        self._stream = self._container.add_stream(codec, rate=sample_rate, layout="mono")
        if bit_rate is not None:
            self._stream.bit_rate = bit_rate
        self._resampler = (av.AudioResampler(format=self._stream.format.name, layout="mono", rate=sample_rate)
                           if sample_rate != OUTPUT_SAMPLE_RATE else None)

    def _mux(self, frame) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def encode(self, chunk: np.ndarray) -> bytes:
        frame = audio_frame(chunk)
        for each in [frame] if self._resampler is None else self._resampler.resample(frame):
            self._mux(each)
        return self._buffer.take()

    def finish(self) -> bytes:
        if self._resampler is not None:
            for each in self._resampler.resample(None):
                self._mux(each)
        self._mux(None)
        self._container.close()
        return self._buffer.take()


class ResampledPCMEncoder:
    """16-bit mono PCM at ``sample_rate``, or G.711 mu-law bytes with ``ulaw``."""

    def __init__(self, sample_rate: int, ulaw: bool = False):
        import av

        self._resampler = av.AudioResampler(format="s16", layout="mono", rate=sample_rate)
        self._ulaw = ulaw

    def _bytes(self, frames) -> bytes:
        samples = [frame.to_ndarray().reshape(-1) for frame in frames]
        s16 = np.concatenate(samples) if samples else np.zeros(0, np.int16)
        return mu_law(s16) if self._ulaw else s16.astype("<i2").tobytes()

    def encode(self, chunk: np.ndarray) -> bytes:
        return self._bytes(self._resampler.resample(audio_frame(np.clip(chunk, -1.0, 1.0))))

    def finish(self) -> bytes:
        return self._bytes(self._resampler.resample(None))


# mu-law's segment ends over 14-bit magnitudes (G.711, as CPython's audioop.lin2ulaw computes it)
_ULAW_SEGMENT_ENDS = np.array([(64 << seg) - 1 for seg in range(8)])


def mu_law(s16: np.ndarray) -> bytes:
    """G.711 mu-law bytes of 16-bit samples."""
    x = s16.astype(np.int32) >> 2
    negative = x < 0
    magnitude = np.minimum(np.where(negative, -x, x), 8159) + (0x84 >> 2)
    segment = np.searchsorted(_ULAW_SEGMENT_ENDS, magnitude)
    value = np.where(segment >= 8, 0x7F, (segment << 4) | ((magnitude >> (segment + 1)) & 0x0F))
    return (value ^ np.where(negative, 0x7F, 0xFF)).astype(np.uint8).tobytes()


# ElevenLabs' output_format names this server speaks (the WebSockets'): kind, rate and kbps
OUTPUT_FORMAT = re.compile(r"(pcm|ulaw|mp3)_(\d+)(?:_(\d+))?")
PCM_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
MP3_RATES = (16000, 22050, 24000, 44100)
MP3_KBPS = (32, 64, 96, 128, 192)


def output_format_encoder(output_format: str) -> PCMEncoder | ResampledPCMEncoder | PyAVEncoder:
    """The encoder of an ElevenLabs ``output_format`` (InvalidInputError for one not spoken here)."""
    match = OUTPUT_FORMAT.fullmatch(output_format or "")
    kind, rate, kbps = (match.group(1), int(match.group(2)), match.group(3)) if match else (None, 0, None)
    if kind == "pcm" and rate in PCM_RATES and kbps is None:
        return PCMEncoder() if rate == OUTPUT_SAMPLE_RATE else ResampledPCMEncoder(rate)
    if kind == "ulaw" and rate == 8000 and kbps is None:
        return ResampledPCMEncoder(8000, ulaw=True)
    if kind == "mp3" and rate in MP3_RATES and kbps is not None and int(kbps) in MP3_KBPS:
        return PyAVEncoder("mp3", rate, int(kbps) * 1000)
    raise InvalidInputError(
        f"output_format {output_format!r} is not supported; use pcm_<rate> ({', '.join(map(str, PCM_RATES))}), "
        f"ulaw_8000 or mp3_<rate>_<kbps> (rates {', '.join(map(str, MP3_RATES))}; kbps "
        f"{', '.join(map(str, MP3_KBPS))})")


def make_encoder(response_format: str) -> PCMEncoder | PyAVEncoder:
    if response_format == "pcm":
        return PCMEncoder()
    if response_format == "wav":
        return PCMEncoder(streaming_wav_header())
    return PyAVEncoder(response_format)
