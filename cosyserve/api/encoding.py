"""Streaming audio encoders for the speech endpoint: float32 24 kHz chunks in, encoded bytes out.

Every encoder returns the bytes ready after each chunk, so a response can be sent while the
audio is still being generated:

* ``pcm``: 16-bit little-endian mono samples, nothing else (OpenAI's raw format);
* ``wav``: a RIFF header whose size fields are 0xFFFFFFFF (length unknown while streaming, as
  streaming WAV writers do), then the same PCM;
* ``mp3``, ``opus`` (in Ogg), ``aac`` (ADTS), ``flac``: PyAV (FFmpeg) encoders and muxers
  writing into a buffer that is drained after every chunk. The Ogg muxer is told to close a page
  every 20 ms instead of buffering a second of audio.
"""

from __future__ import annotations

import struct

import numpy as np

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


class PyAVEncoder:
    def __init__(self, response_format: str, sample_rate: int = OUTPUT_SAMPLE_RATE):
        import av

        muxer, codec, options = PYAV_FORMATS[response_format]
        self._av = av
        self._buffer = _Buffer()
        self._container = av.open(self._buffer, mode="w", format=muxer, options=options)
        self._stream = self._container.add_stream(codec, rate=sample_rate, layout="mono")
        self._sample_rate = sample_rate

    def encode(self, chunk: np.ndarray) -> bytes:
        frame = self._av.AudioFrame.from_ndarray(np.ascontiguousarray(chunk, np.float32)[None], format="flt",
                                                 layout="mono")
        frame.sample_rate = self._sample_rate
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._buffer.take()

    def finish(self) -> bytes:
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._buffer.take()


def make_encoder(response_format: str) -> PCMEncoder | PyAVEncoder:
    if response_format == "pcm":
        return PCMEncoder()
    if response_format == "wav":
        return PCMEncoder(streaming_wav_header())
    return PyAVEncoder(response_format)
