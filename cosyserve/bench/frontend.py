"""New voices through the front end (``scripts/bench_frontend.py``): the speech tokenizer, CAM++
and the whole voice (tokens, embedding, prompt mel) for clips never seen before, per back end,
device and batch size.

Each round draws ``batch`` fresh synthetic clips of 3-8 s (no cache anywhere on this path) and
times ``tokenize_batch``, ``embed_batch`` and :func:`~cosyserve.frontend.prompt.build_prompt_features_batch`
(the prompt mel on the models' device) on three separate draws; a row is the median over the rounds.
On CUDA each PyTorch back end (``torch``: TF32, what the servers run; ``torch-fp32``: exact float32)
is timed twice: eager, and replaying its CUDA graphs (what the servers run). Outputs are CPU
tensors, so every call has waited for the device. Each PyTorch row also checks its clips against
onnxruntime on the CPU (float32): clips whose codes are all equal and the share of equal codes,
largest embedding rel-L2.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..audio.features import TOKENIZER_SAMPLE_RATE
from ..audio.io import PromptAudio, prompt_audio_from_array
from ..bundle import synthetic_prompt_wave
from ..frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
from ..frontend.prompt import COSYVOICE2_MEL_FMAX, build_prompt_features_batch
from ..frontend.torch_models import (ONNXRUNTIME, TORCH, TORCH_FP32, TorchSpeakerEncoder, TorchSpeechTokenizer,
                                     load_speaker_encoder, load_speech_tokenizer)
from .report import fmt, table

COLUMNS = ["back end", "device", "batch", "rounds", "tokenizer ms", "CAM++ ms", "voice ms", "voice ms per clip",
           "tokens equal to onnxruntime", "embedding rel-L2 max"]


@dataclass
class Row:
    backend: str
    device: str
    batch: int
    rounds: int
    tokenizer_ms: float
    campplus_ms: float
    voice_ms: float
    tokens_equal: str = "-"
    embedding_rel_l2: float | None = None

    def cells(self) -> list[str]:
        return [self.backend, self.device, str(self.batch), str(self.rounds), fmt(self.tokenizer_ms),
                fmt(self.campplus_ms), fmt(self.voice_ms), fmt(self.voice_ms / self.batch), self.tokens_equal,
                "-" if self.embedding_rel_l2 is None else f"{self.embedding_rel_l2:.1e}"]


class NewClips:
    """Distinct clips of ``min_s``-``max_s`` seconds, a new seed each: every clip is one never seen."""

    def __init__(self, min_s: float, max_s: float, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.min_s, self.max_s = min_s, max_s
        self.next_seed = seed

    def draw(self, count: int) -> list[PromptAudio]:
        clips = []
        for _ in range(count):
            self.next_seed += 1
            seconds = float(self.rng.uniform(self.min_s, self.max_s))
            clips.append(prompt_audio_from_array(synthetic_prompt_wave(seconds, seed=self.next_seed),
                                                  TOKENIZER_SAMPLE_RATE))
        return clips


def _ms(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def measure(tokenizer, encoder, backend: str, device: str, batch: int, rounds: int, warmup: int, clips: NewClips,
            mel_fmax: float | None) -> Row:
    timings: dict[str, list[float]] = {"tokenizer": [], "campplus": [], "voice": []}
    for round_index in range(warmup + rounds):
        wavs = [[audio.wav16 for audio in clips.draw(batch)] for _ in range(2)]
        voices = clips.draw(batch)
        times = {"tokenizer": _ms(lambda: tokenizer.tokenize_batch(wavs[0])),
                 "campplus": _ms(lambda: encoder.embed_batch(wavs[1])),
                 "voice": _ms(lambda: build_prompt_features_batch(
                     voices, tokenizer, encoder, mel_fmax, device=getattr(tokenizer, "device", None),
                     stream=getattr(tokenizer, "stream", None)))}
        if round_index >= warmup:
            for name, value in times.items():
                timings[name].append(value)
    median = {name: statistics.median(values) for name, values in timings.items()}
    return Row(backend, device, batch, rounds, median["tokenizer"], median["campplus"], median["voice"])


def check_against_onnxruntime(row: Row, tokenizer, encoder, reference_tokenizer: SpeechTokenizer,
                              reference_encoder: SpeakerEncoder, clips: NewClips) -> None:
    wavs = [audio.wav16 for audio in clips.draw(row.batch)]
    tokens, embeddings = tokenizer.tokenize_batch(wavs), encoder.embed_batch(wavs)
    references = [reference_tokenizer.tokenize(wav) for wav in wavs]
    equal = sum(torch.equal(ours, ref) for ours, ref in zip(tokens, references))
    # codes equal position by position (a clip whose length differs counts its extra codes as unequal)
    same = sum(int((ours[:len(ref)] == ref[:len(ours)]).sum()) for ours, ref in zip(tokens, references))
    total = sum(max(len(ours), len(ref)) for ours, ref in zip(tokens, references))
    row.tokens_equal = f"{equal}/{len(wavs)} clips, {100 * same / max(total, 1):.2f} % of codes"
    row.embedding_rel_l2 = max(float((ours - ref).norm() / ref.norm()) for ours, ref in
                               zip(embeddings, (reference_encoder.embed(wav) for wav in wavs)))


def _variants(device: str, backends: Sequence[str]) -> list[str]:
    """The back ends to time on ``device``: on CUDA each PyTorch one twice, eager and with its graphs."""
    cuda = torch.device(device).type == "cuda"
    return [variant for backend in backends
            for variant in ((f"{backend} eager", f"{backend} graphs") if backend != ONNXRUNTIME and cuda
                            else (backend,))]


def _load(variant: str, tokenizer_path: Path, speaker_path: Path, device: str):
    if variant.startswith(TORCH):
        graphs, tf32 = variant.endswith("graphs"), not variant.startswith(TORCH_FP32)
        models = (TorchSpeechTokenizer(tokenizer_path, device, graphs, tf32),
                  TorchSpeakerEncoder(speaker_path, device, graphs, tf32))
        for model in models:
            model.capture_all()  # at load, as the servers do (not timed)
        return models
    return load_speech_tokenizer(tokenizer_path, device, variant), load_speaker_encoder(speaker_path, device, variant)


def run(model_dir: Path, tokenizer_file: str, devices: Sequence[str], backends: Sequence[str],
        batches: Sequence[int], rounds: int, warmup: int, min_s: float = 3.0, max_s: float = 8.0,
        mel_fmax: float | None = COSYVOICE2_MEL_FMAX, progress: Callable[[str], None] = print) -> list[Row]:
    tokenizer_path, speaker_path = model_dir / tokenizer_file, model_dir / "campplus.onnx"
    reference = (SpeechTokenizer(tokenizer_path, ["CPUExecutionProvider"]), SpeakerEncoder(speaker_path))
    clips = NewClips(min_s, max_s)
    rows = []
    for device in devices:
        for backend in _variants(device, backends):
            loading = time.perf_counter()
            tokenizer, encoder = _load(backend, tokenizer_path, speaker_path, device)
            progress(f"{backend} on {device}: loaded (graphs captured) in {time.perf_counter() - loading:.1f} s")
            for batch in batches:
                row = measure(tokenizer, encoder, backend, device, batch, rounds, warmup, clips, mel_fmax)
                if backend.startswith(TORCH):
                    check_against_onnxruntime(row, tokenizer, encoder, *reference, clips)
                progress(" | ".join(row.cells()))
                rows.append(row)
    return rows


def report(rows: list[Row], model_dir: Path, tokenizer_file: str) -> str:
    head = (f"New {tokenizer_file} + campplus.onnx voices from {model_dir}, clips of 3-8 s never seen before; "
            f"times are medians per batch (ms), '{ONNXRUNTIME}' runs one clip at a time.\n\n")
    return head + table(COLUMNS, [row.cells() for row in rows])
