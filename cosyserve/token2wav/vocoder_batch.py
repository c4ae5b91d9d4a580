"""HiFT calls of many streams and requests run together: one call per (mel frames, cached samples) shape.

HiFT is not causal and its calls differ in length, so rows are batched by exact shape (graphs
are keyed by shape too, :class:`~.graphs.HiftRunner`). Each call's harmonic-source noise is drawn
per call in the callers' order, as unbatched calls would draw it; the random initial phases HiFT
would also draw never reach its output (fixture README §5.2).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InvalidInputError
from ..models.hift import draw_source_noise
from .graphs import HiftRunner
from .vocoder_stream import SineNoiseProvider, VocoderCall


def source_noise(call: VocoderCall, harmonics: int, device: torch.device, generator: torch.Generator | None,
                 provider: SineNoiseProvider | None) -> torch.Tensor:
    """The harmonic-source noise (1, samples, harmonics) of ``call``: drawn on ``generator`` (the
    device's default generator if None), or given by ``provider`` (recorded or zero noise)."""
    if provider is None:
        return draw_source_noise(1, call.samples, harmonics, device, generator).sine_noise
    noise = provider(call.samples)
    if tuple(noise.shape) != (1, call.samples, harmonics):
        raise InvalidInputError(f"sine_noise must have shape {(1, call.samples, harmonics)}, got {tuple(noise.shape)}")
    return noise


def vocode_batch(runner: HiftRunner, calls: Sequence[VocoderCall],
                 noises: Sequence[torch.Tensor | None]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """HiFT (speech (1, S), source (1, 1, S)) of each needed call, None for the others; ``noises``
    per call (None where not needed)."""
    device = runner.hift.conv_pre.weight.device
    groups: dict[tuple[int, int], list[int]] = {}
    for i, call in enumerate(calls):
        if call.needed:
            cached = -1 if call.cache_source is None else call.cache_source.shape[-1]
            groups.setdefault((call.mel_in.shape[2], cached), []).append(i)
    outputs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(calls)
    for (_, cached), members in groups.items():
        mel = torch.cat([calls[i].mel_in for i in members])
        cache = None if cached < 0 else torch.cat([calls[i].cache_source for i in members])
        noise = torch.cat([noises[i].to(device) for i in members])
        speech, source = runner(mel, cache, noise)
        for row, i in enumerate(members):
            outputs[i] = (speech[row:row + 1], source[row:row + 1])
    return outputs
