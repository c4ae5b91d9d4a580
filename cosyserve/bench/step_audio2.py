"""Step-Audio2's token2wav alone (``token2wav.py --model step_audio2``): speech tokens -> 24 kHz audio
through the engine's kind (:class:`~cosyserve.engine.kinds.step_audio2.StepAudio2Kind`), offline or
streamed in the chunks the ``cosyvoice2_dit`` model sends (``exponential``: 15, 25, 50, ... new
tokens; ``equal``: 15 each; +3 look-ahead), as if the LLM were infinitely fast. One stream or
offline request at a time; every chunk's flow steps and HiFT call are timed (the device
synchronised). Variants are flow dtypes (``fp32``, ``fp16``, ``bf16``; HiFT stays fp32). The first
run of each variant is an untimed warm-up (it also builds the voice's prompt state).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..audio.io import load_prompt_audio
from ..engine.device import synchronize
from ..engine.kinds.step_audio2 import StepAudio2Kind, load_step_audio2_frontend, load_step_audio2_kind
from ..errors import InvalidInputError
from ..frontend.prompt import PromptFeatures, build_prompt_features
from ..frontend.speakers import SpeakerRegistry
from ..schedule import OUTPUT_SAMPLE_RATE
from .token2wav import DTYPES, median

MODES = ("offline", "streaming")
HEADER = ["variant", "mode", "utterances", "chunks", "audio s", "first chunk ms (median)", "wall ms", "RTF"]


def step_audio2_voice(model_dir: Path, device: str, reference_audio: Path | None = None,
                      spk2info: Path | None = None, speaker_id: str = "001") -> PromptFeatures:
    """A reference clip through the directory's own front-end files, or a voice of ``spk2info``
    (CosyVoice2's spk2info.pt)."""
    if reference_audio is not None:
        tokenizer, speaker_encoder = load_step_audio2_frontend(model_dir, device)
        return build_prompt_features(load_prompt_audio(reference_audio), tokenizer, speaker_encoder)
    if spk2info is None:
        raise InvalidInputError("--model step_audio2 needs --reference-audio, or --spk2info (CosyVoice2's "
                                "spk2info.pt) and --speaker-id")
    return SpeakerRegistry.load(spk2info).get(speaker_id).features


@dataclass
class Run:
    pieces: list[np.ndarray] = field(default_factory=list)  # per utterance, its audio
    chunk_s: list[list[float]] = field(default_factory=list)  # per utterance, each chunk's wall time

    @property
    def wall_s(self) -> float:
        return sum(sum(times) for times in self.chunk_s)

    @property
    def audio_s(self) -> float:
        return sum(piece.size for piece in self.pieces) / OUTPUT_SAMPLE_RATE


def _finish(kind: StepAudio2Kind, voicing, job) -> np.ndarray:
    while not job.done:
        kind.step([job])
    (pcm,) = kind.vocode([(voicing, kind.mel(job), job.finalize)])
    synchronize(kind.device)
    return pcm


def voice_utterance(kind: StepAudio2Kind, features: PromptFeatures, tokens: list[int], mode: str,
                    strategy: str) -> tuple[np.ndarray, list[float]]:
    """The audio of ``tokens`` and the wall time of each chunk (offline: one)."""
    if mode == "offline":
        start = time.perf_counter()
        pcm = _finish(kind, None, kind.start_offline(features, tokens))
        return pcm, [time.perf_counter() - start]
    if mode != "streaming":
        raise InvalidInputError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    schedule = kind.chunk_schedule(strategy)
    voicing = kind.open(features)
    pieces, times = [], []
    try:
        finished = False
        while not finished:
            chunk = schedule.next_chunk(len(tokens)) or schedule.final_chunk(len(tokens))
            finished = chunk.finalize
            start = time.perf_counter()
            (job,) = kind.start_chunks([(voicing, tokens[:chunk.num_tokens], chunk.token_offset, chunk.finalize)])
            pieces.append(_finish(kind, voicing, job))
            times.append(time.perf_counter() - start)
    finally:
        voicing.close()
    return np.concatenate(pieces), times


def run_step_audio2(model_dir: Path, tokens: list[torch.Tensor], features: PromptFeatures, *, device: str,
                    variants: list[str], mode: str, strategy: str, runs: int, on_row=None):
    """One row of :data:`HEADER` per variant, and the last utterance's audio of the last variant."""
    unknown = [v for v in variants if v not in DTYPES]
    if unknown:
        raise InvalidInputError(f"unknown variant(s) {unknown}; --model step_audio2 takes flow dtypes {sorted(DTYPES)}")
    utterances = [t.tolist() for t in tokens]
    rows, last = [], None
    for variant in variants:
        kind = load_step_audio2_kind(model_dir, device, DTYPES[variant])
        kind.chunk_schedule(strategy)  # an unknown strategy fails here
        results = []
        for k in range(max(1, runs) + 1):  # the first: warm-up
            run = Run()
            for utterance in utterances:
                pcm, times = voice_utterance(kind, features, utterance, mode, strategy)
                run.pieces.append(pcm)
                run.chunk_s.append(times)
            if k:
                results.append(run)
        wall = median([r.wall_s for r in results])
        row = [variant, mode, len(utterances), sum(len(t) for t in results[0].chunk_s), results[0].audio_s,
               1e3 * median([t[0] for r in results for t in r.chunk_s]), 1e3 * wall, wall / results[0].audio_s]
        rows.append(row)
        last = results[-1].pieces[-1]
        if on_row is not None:
            on_row(row)
    return rows, last
