"""onnxruntime wrappers of the two front-end models, called the way the reference calls them.

* :class:`SpeechTokenizer` - ``speech_tokenizer_v2.onnx`` / ``_v3`` (S3 tokenizer, 25 tokens/s,
  6561 codes): 16 kHz audio -> Whisper 128-bin log-mel -> token ids.
* :class:`SpeakerEncoder` - ``campplus.onnx`` (CAM++): 16 kHz audio -> mean-normalised
  Kaldi fbank -> 192-dim speaker embedding.

Input and output names are read from the session by position, never hard-coded (llm_layout.md
§6). The input checks and result checks here are shared with the PyTorch back end
(:mod:`cosyserve.frontend.torch_models`), so both refuse the same clips with the same errors. Sessions use ``ORT_ENABLE_ALL``; ``InferenceSession.run`` is thread-safe, so one
instance serves concurrent requests.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from ..audio.features import WHISPER_N_FFT, campplus_features, kaldi_frame_count, whisper_log_mel
from ..audio.io import MAX_PROMPT_SECONDS, TOKENIZER_SAMPLE_RATE
from ..errors import InvalidInputError, ModelLoadError

SPEECH_TOKEN_VOCAB = 6561  # 3^8 FSQ codes
SPEAKER_EMBEDDING_DIM = 192
WHISPER_N_MELS = 128


def open_session(path: str | Path, providers: list[str] | None = None, intra_op_threads: int = 1,
                 n_inputs: int = 1) -> ort.InferenceSession:
    """Open an ONNX model; ``providers=None`` takes CUDA when onnxruntime has it, else CPU."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"ONNX model {path} does not exist")
    if providers is None:
        available = ort.get_available_providers()
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as exc:  # onnxruntime raises its own untyped errors for bad files
        raise ModelLoadError(f"cannot load ONNX model {path}: {exc}") from exc
    if len(session.get_inputs()) < n_inputs or not session.get_outputs():
        raise ModelLoadError(f"ONNX model {path} has {len(session.get_inputs())} inputs and "
                             f"{len(session.get_outputs())} outputs; expected {n_inputs} inputs and an output")
    return session


def _check_wav16(wav16: torch.Tensor) -> torch.Tensor:
    if wav16.dim() != 1 or wav16.numel() == 0:
        raise InvalidInputError(f"expected a non-empty 1-D 16 kHz waveform, got shape {tuple(wav16.shape)}")
    return wav16.detach().to("cpu", torch.float32)


def tokenizer_input(wav16: torch.Tensor) -> torch.Tensor:
    """A clip the speech tokenizer accepts (1-D, at most 30 s, longer than half an STFT window) as
    float32 on the CPU; anything else raises InvalidInputError. Both back ends check with this."""
    wav16 = _check_wav16(wav16)
    if wav16.numel() > MAX_PROMPT_SECONDS * TOKENIZER_SAMPLE_RATE:
        raise InvalidInputError(f"speech tokenizer input is {wav16.numel() / TOKENIZER_SAMPLE_RATE:.2f} s; "
                                f"at most {MAX_PROMPT_SECONDS:g} s is supported")
    if wav16.numel() <= WHISPER_N_FFT // 2:
        raise InvalidInputError(f"audio too short for the speech tokenizer: {wav16.numel()} samples "
                                f"(needs > {WHISPER_N_FFT // 2})")
    return wav16


def speaker_input(wav16: torch.Tensor) -> torch.Tensor:
    """A clip the speaker encoder accepts (1-D, at least one fbank frame) as float32 on the CPU."""
    wav16 = _check_wav16(wav16)
    if kaldi_frame_count(wav16.numel()) == 0:
        raise InvalidInputError(f"audio of {wav16.numel()} samples is too short for the speaker encoder")
    return wav16


def checked_tokens(tokens: torch.Tensor, path: Path) -> torch.Tensor:
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= SPEECH_TOKEN_VOCAB):
        raise ModelLoadError(f"{path} produced speech token ids outside [0, {SPEECH_TOKEN_VOCAB}); "
                             "is it a CosyVoice speech tokenizer model?")
    return tokens


def checked_embedding(embedding: torch.Tensor, path: Path) -> torch.Tensor:
    if embedding.numel() != SPEAKER_EMBEDDING_DIM:
        raise ModelLoadError(f"{path} produced {embedding.numel()} values; a CosyVoice speaker "
                             f"embedding has {SPEAKER_EMBEDDING_DIM}")
    return embedding


class SpeechTokenizer:
    """``speech_tokenizer_v2.onnx``: ``tokenize(wav16 (N,)) -> int32 (T',)``, about 25 ids per second."""

    def __init__(self, path: str | Path, providers: list[str] | None = None, intra_op_threads: int = 1):
        self.path = Path(path)
        self.session = open_session(path, providers, intra_op_threads, n_inputs=2)
        inputs = self.session.get_inputs()
        self._feats_name, self._length_name = inputs[0].name, inputs[1].name
        self._output_name = self.session.get_outputs()[0].name

    def tokenize(self, wav16: torch.Tensor) -> torch.Tensor:
        log_mel = whisper_log_mel(tokenizer_input(wav16), n_mels=WHISPER_N_MELS).unsqueeze(0)  # (1, 128, T)
        (codes,) = self.session.run([self._output_name], {
            self._feats_name: log_mel.numpy(),
            self._length_name: np.array([log_mel.shape[2]], dtype=np.int32),
        })
        return checked_tokens(torch.from_numpy(np.ascontiguousarray(codes).reshape(-1).astype(np.int32)), self.path)

    def tokenize_batch(self, wavs16: list[torch.Tensor]) -> list[torch.Tensor]:
        """One session run per clip: the released graph takes one clip."""
        return [self.tokenize(wav16) for wav16 in wavs16]

    def start_batch(self, wavs16: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        """:meth:`tokenize_batch`, computed now (as the device back end's, a function giving it)."""
        return partial(list, self.tokenize_batch(wavs16))


class SpeakerEncoder:
    """``campplus.onnx``: ``embed(wav16 (N,)) -> float32 (192,)``, the raw (unnormalised) x-vector."""

    def __init__(self, path: str | Path, providers: list[str] | None = None, intra_op_threads: int = 1):
        self.path = Path(path)
        # Upstream runs CAM++ on the CPU provider: it is small and its inputs are already there.
        self.session = open_session(path, providers or ["CPUExecutionProvider"], intra_op_threads)
        self._input_name = self.session.get_inputs()[0].name
        self._output_name = self.session.get_outputs()[0].name

    def embed(self, wav16: torch.Tensor) -> torch.Tensor:
        feats = campplus_features(speaker_input(wav16))
        (embedding,) = self.session.run([self._output_name], {self._input_name: feats.numpy()})
        return checked_embedding(torch.from_numpy(np.ascontiguousarray(embedding, dtype=np.float32).reshape(-1)),
                                 self.path)

    def embed_batch(self, wavs16: list[torch.Tensor]) -> list[torch.Tensor]:
        """One session run per clip (clips of different lengths cannot share the graph's batch)."""
        return [self.embed(wav16) for wav16 in wavs16]

    def start_batch(self, wavs16: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        """:meth:`embed_batch`, computed now (as the device back end's, a function giving it)."""
        return partial(list, self.embed_batch(wavs16))
