"""The front-end models in PyTorch on any device, batched, and the choice between the two back ends.

* :class:`TorchSpeechTokenizer` - the S3 tokenizer (v2 or v3 ONNX file, weights loaded by
  :func:`~cosyserve.frontend.s3_tokenizer.load_s3_tokenizer`): Whisper log-mel and the model on
  ``device`` over a zero-padded batch of clips.
* :class:`TorchSpeakerEncoder` - CAM++ (:func:`~cosyserve.frontend.campplus.load_campplus`):
  mean-normalised Kaldi fbank and the model on ``device``, batched the same way.

Both have the interface of the onnxruntime wrappers (``tokenize``/``embed`` one clip,
``tokenize_batch``/``embed_batch`` several; CPU tensors out), check clips with the same
functions, and give each clip of a batch what it gives the clip alone. On CUDA each runs on a
stream of its own (never a process's default stream, which would wait for, and hold up, every
other stream of the device), replaying CUDA graphs per shape bucket (:class:`~.graphs.ClipGraphs`;
``cuda_graphs=False``: eager launches).
:func:`load_frontend_models` picks the back end: PyTorch on CUDA, onnxruntime (the released
graphs, the parity reference) on the CPU, unless told otherwise.

Precision on CUDA: back end ``torch`` runs the models' float32 matmuls and convolutions as TF32 on
tensor cores, as onnxruntime's CUDA execution provider does by default (its ``use_tf32``), which is
how upstream CosyVoice computes a new clip's tokens and embedding on a GPU. Exact float32 is
several times slower there (the v2 S3 tokenizer applies ~120M parameters to every 40 ms frame:
~0.4 TFLOP for 8 clips of 8 s), and it is what ``torch-fp32`` runs: codes equal to onnxruntime's on the CPU. TF32 may
move an FSQ code that sits on a rounding edge; ``scripts/bench_frontend.py`` counts them. On the
CPU both back ends compute in float32.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from ..audio.features import WHISPER_HOP, campplus_features, kaldi_frame_count, whisper_log_mel
from ..errors import InvalidInputError, ModelLoadError
from ..runtime import device_to_host, role_stream
from .campplus import load_campplus
from .graphs import GRAPH_BATCHES, ClipGraphs
from .onnx_models import (
    WHISPER_N_MELS,
    SpeakerEncoder,
    SpeechTokenizer,
    checked_embedding,
    checked_tokens,
    speaker_input,
    tokenizer_input,
)
from .s3_tokenizer import load_s3_tokenizer

TORCH = "torch"
TORCH_FP32 = "torch-fp32"
ONNXRUNTIME = "onnxruntime"
FRONTEND_BACKENDS = (TORCH, TORCH_FP32, ONNXRUNTIME)


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"ONNX model {path} does not exist")
    return path


@contextmanager
def _float32_math(device: torch.device, tf32: bool):
    """The models' float32 matmuls and convolutions on CUDA: TF32 (``tf32``) or exact float32 (the
    process-wide flags are restored afterwards; a CUDA graph keeps the modes it was captured with).
    (cuDNN's autotuning is left off: timing every convolution of every captured shape took minutes.)"""
    if device.type != "cuda":
        yield
        return
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)


def _padded(wavs16: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Clips -> zero-padded ``(B, N)`` batch and ``(B,)`` lengths on ``device``."""
    lengths = torch.tensor([wav.numel() for wav in wavs16], device=device)
    return pad_sequence([wav.to(device) for wav in wavs16], batch_first=True), lengths


class _DeviceModel:
    """A model loaded from its ONNX file onto ``device``, run on zero-padded batches of clips:
    ``forward(batch (B, N), lengths (B,))`` (a subclass's), at most :data:`~.graphs.GRAPH_BATCHES`'s
    largest clips per call on CUDA (larger calls are split). ``tf32``: TF32 math on CUDA (see the
    module's doc), else exact float32."""

    def __init__(self, path: str | Path, device: str | torch.device, loader, cuda_graphs: bool = True,
                 tf32: bool = True):
        self.path = _existing(path)
        self.device = torch.device(device)
        self.model = loader(self.path).to(self.device)
        self.tf32 = tf32
        cuda = self.device.type == "cuda"
        # its own stream, where its graphs are captured too (runtime.role_stream: one per model file)
        self.stream = role_stream(self.device, f"frontend:{self.path}") if cuda else None
        self.graphs = ClipGraphs(self.device, self.forward, self._math) if cuda and cuda_graphs else None
        self._lock = threading.Lock()  # one call at a time: the graphs' buffers are shared

    def forward(self, batch: torch.Tensor, lengths: torch.Tensor):
        raise NotImplementedError

    def _math(self):
        return _float32_math(self.device, self.tf32)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every shape bucket's graph now (at load), not on a first call of that shape."""
        if self.graphs is not None:
            with self._lock, torch.cuda.stream(self.stream):
                self.graphs.capture_all()

    @torch.inference_mode()
    def _start(self, wavs16: Sequence[torch.Tensor], check, gather) -> Callable[[], list]:
        """The checked clips through :meth:`forward`, launched on the device; returns a function that
        waits for them and gives ``gather(outputs, clips)`` of each call (CPU results, one per clip),
        so that the caller can launch other work first (on the CPU: computed now)."""
        clips = [check(wav) for wav in wavs16]
        if self.stream is None:
            with self._math():
                results = gather(self.forward(*_padded(clips, self.device)), len(clips))
            return lambda: results
        calls = []
        with self._lock, torch.cuda.stream(self.stream):
            for start in range(0, len(clips), GRAPH_BATCHES[-1]):
                part = clips[start:start + GRAPH_BATCHES[-1]]
                replayed = self.graphs.run(part) if self.graphs is not None else None
                if replayed is None:
                    with self._math():
                        calls.append((self.forward(*_padded(part, self.device)), len(part)))
                    continue
                outputs, count = replayed
                # a graph's outputs are buffers its next replay overwrites: copied, in stream order
                calls.append((tuple(t.clone() for t in outputs) if isinstance(outputs, tuple) else outputs.clone(),
                              count))

        def wait() -> list:
            with torch.cuda.stream(self.stream):  # the copies to the host after the model's work
                return [result for outputs, count in calls for result in gather(outputs, count)]
        return wait


class TorchSpeechTokenizer(_DeviceModel):
    """``tokenize(wav16 (N,)) -> int32 (T',)``; ``tokenize_batch`` runs the clips together."""

    def __init__(self, path: str | Path, device: str | torch.device = "cpu", cuda_graphs: bool = True,
                 tf32: bool = True):
        super().__init__(path, device, load_s3_tokenizer, cuda_graphs, tf32)

    def forward(self, batch: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(whisper_log_mel(batch, WHISPER_N_MELS, lengths), lengths // WHISPER_HOP)

    def tokenize(self, wav16: torch.Tensor) -> torch.Tensor:
        return self.tokenize_batch([wav16])[0]

    def tokenize_batch(self, wavs16: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.start_batch(wavs16)()

    def start_batch(self, wavs16: Sequence[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        """:meth:`tokenize_batch` launched: a function that waits for its codes."""
        def gather(outputs, clips: int) -> list[torch.Tensor]:
            codes, counts = (device_to_host(tensor[:clips]) for tensor in outputs)
            return [checked_tokens(codes[i, :count].clone(), self.path) for i, count in enumerate(counts.tolist())]
        return self._start(wavs16, tokenizer_input, gather) if wavs16 else list


class TorchSpeakerEncoder(_DeviceModel):
    """``embed(wav16 (N,)) -> float32 (192,)`` raw CAM++ x-vector; ``embed_batch`` runs the clips together."""

    def __init__(self, path: str | Path, device: str | torch.device = "cpu", cuda_graphs: bool = True,
                 tf32: bool = True):
        super().__init__(path, device, load_campplus, cuda_graphs, tf32)

    def forward(self, batch: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.model(campplus_features(batch, lengths), kaldi_frame_count(lengths))

    def embed(self, wav16: torch.Tensor) -> torch.Tensor:
        return self.embed_batch([wav16])[0]

    def embed_batch(self, wavs16: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.start_batch(wavs16)()

    def start_batch(self, wavs16: Sequence[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        """:meth:`embed_batch` launched: a function that waits for its embeddings."""
        def gather(embeddings: torch.Tensor, clips: int) -> list[torch.Tensor]:
            return [checked_embedding(embedding.clone(), self.path)
                    for embedding in device_to_host(embeddings[:clips].float())]
        return self._start(wavs16, speaker_input, gather) if wavs16 else list


def frontend_backend(device: str | torch.device, backend: str | None = None) -> str:
    """``backend`` as given (``torch``, ``torch-fp32`` or ``onnxruntime``), or the default for
    ``device``: PyTorch on CUDA (batched on the GPU, TF32), onnxruntime on the CPU (the released
    graphs themselves)."""
    if backend in (None, "", "auto"):
        return TORCH if torch.device(device).type == "cuda" else ONNXRUNTIME
    if backend not in FRONTEND_BACKENDS:
        raise InvalidInputError(f"unknown front-end backend {backend!r}; use one of {FRONTEND_BACKENDS} or auto")
    return backend


def load_speech_tokenizer(path: str | Path, device: str | torch.device = "cpu",
                          backend: str | None = None) -> TorchSpeechTokenizer | SpeechTokenizer:
    """The speech tokenizer of ``path`` on ``device`` with the chosen back end (:func:`frontend_backend`);
    onnxruntime takes its CUDA provider for a CUDA device when it has one."""
    backend = frontend_backend(device, backend)
    if backend != ONNXRUNTIME:
        return TorchSpeechTokenizer(path, device, tf32=backend == TORCH)
    return SpeechTokenizer(path, None if torch.device(device).type == "cuda" else ["CPUExecutionProvider"])


def load_speaker_encoder(path: str | Path, device: str | torch.device = "cpu",
                         backend: str | None = None) -> TorchSpeakerEncoder | SpeakerEncoder:
    """CAM++ of ``path`` on ``device`` with the chosen back end (onnxruntime: its CPU provider, as upstream)."""
    backend = frontend_backend(device, backend)
    if backend != ONNXRUNTIME:
        return TorchSpeakerEncoder(path, device, tf32=backend == TORCH)
    return SpeakerEncoder(path)


def load_frontend_models(tokenizer_path: str | Path, speaker_path: str | Path, device: str | torch.device = "cpu",
                         backend: str | None = None):
    """(speech tokenizer, speaker encoder) for a model directory's two ONNX files."""
    return (load_speech_tokenizer(tokenizer_path, device, backend),
            load_speaker_encoder(speaker_path, device, backend))
