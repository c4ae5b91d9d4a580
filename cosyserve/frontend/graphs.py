"""CUDA graphs of a front-end model over zero-padded batches of clips, one per shape bucket.

Eager, CAM++ is ~1,750 small launches per call (the S3 tokenizer a few hundred): on a GPU its time is
the host's, and in a server process whose GIL other threads hold it is that time stretched many
times over. A replay is one launch. :class:`ClipGraphs` pads a call to the next bucket of clips
(:data:`GRAPH_BATCHES`) and of samples (:data:`GRAPH_SECONDS` of 16 kHz audio) and replays the
graph of that shape; padding clips are silence as long as the bucket, which both models mask out of
every real clip (their batched paths give each clip what it gives alone). A call past the largest
bucket runs eagerly.

Inputs are copied into the graph's own buffers in one host-to-device copy from pinned memory; the
outputs are views of the graph's buffers, valid until the next replay of any shape (the shapes share
one memory pool), so callers copy them out first: the owner runs one call at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..audio.features import TOKENIZER_SAMPLE_RATE
from ..runtime import bucket

# Clips per call and seconds per clip of the captured shapes (a prompt clip is 0.5-30 s).
GRAPH_BATCHES = (1, 2, 4, 8)
GRAPH_SECONDS = (2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30)

Forward = Callable[[torch.Tensor, torch.Tensor], object]  # (batch (B, N) float32, lengths (B,) int64) -> outputs


@dataclass
class _Shape:
    wav: torch.Tensor  # (B, N) float32 on the device
    lengths: torch.Tensor  # (B,) int64 on the device
    host: torch.Tensor  # (B, N + 1) float32 pinned: the samples, then each clip's length
    graph: torch.cuda.CUDAGraph
    outputs: object


class ClipGraphs:
    """``forward`` captured per (clips, samples) bucket on ``device``; :meth:`run` replays one.
    ``precision``: the context every capture happens in (the models' float32 precision; a graph keeps
    the math modes it was captured with)."""

    def __init__(self, device: torch.device, forward: Forward, precision: Callable) -> None:
        self.device = device
        self.forward = forward
        self.precision = precision
        self.pool = torch.cuda.graph_pool_handle()
        self._shapes: dict[tuple[int, int], _Shape] = {}

    @property
    def captured(self) -> int:
        return len(self._shapes)

    def shape_of(self, clips: int, samples: int) -> tuple[int, int] | None:
        """The bucket of a call of ``clips`` clips, the longest ``samples`` long (None: past the largest)."""
        batch = bucket(clips, GRAPH_BATCHES)
        seconds = bucket(-(-samples // TOKENIZER_SAMPLE_RATE), GRAPH_SECONDS)
        return None if batch is None or seconds is None else (batch, seconds * TOKENIZER_SAMPLE_RATE)

    def run(self, wavs: Sequence[torch.Tensor]) -> tuple[object, int] | None:
        """Replay the graph of the call's bucket over ``wavs`` (CPU float32 clips); its outputs (views,
        padding clips and samples included) and the bucket's clip count, or None past the buckets."""
        shape = self.shape_of(len(wavs), max(wav.numel() for wav in wavs))
        if shape is None:
            return None
        entry = self._shapes.get(shape) or self._capture(shape)
        host = entry.host
        samples = shape[1]
        for i, wav in enumerate(wavs):  # each clip, zeros after it, its length
            host[i, :wav.numel()] = wav
            host[i, wav.numel():samples] = 0
            host[i, samples] = wav.numel()
        host[len(wavs):, :samples] = 0  # padding clips: silence, as long as the bucket
        host[len(wavs):, samples] = samples
        on_device = host.to(self.device, non_blocking=True)
        entry.wav.copy_(on_device[:, :samples])
        entry.lengths.copy_(on_device[:, samples])
        entry.graph.replay()
        return entry.outputs, shape[0]

    def capture_all(self) -> None:
        for batch in GRAPH_BATCHES:
            for seconds in GRAPH_SECONDS:
                shape = (batch, seconds * TOKENIZER_SAMPLE_RATE)
                if shape not in self._shapes:
                    self._capture(shape)

    def _capture(self, shape: tuple[int, int]) -> _Shape:
        batch, samples = shape
        wav = torch.zeros(batch, samples, device=self.device)
        lengths = torch.full((batch,), samples, device=self.device, dtype=torch.int64)
        host = torch.zeros(batch, samples + 1, pin_memory=True)
        stream = torch.cuda.current_stream(self.device)
        with self.precision():
            self.forward(wav, lengths)  # kernels chosen and compiled, workspaces made, outside the graph
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                outputs = self.forward(wav, lengths)
        self._shapes[shape] = entry = _Shape(wav, lengths, host, graph, outputs)
        return entry
