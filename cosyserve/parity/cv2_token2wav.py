"""Parity suite "cv2_token2wav": the Triton token2wav composition against ``token2wav_stream.safetensors``.

Runs :class:`CosyVoice2Token2Wav` (tiny flow + tiny HiFT) through the recorded chunk schedule
(``fixture_meta.json``) with the recorded seed protocol: one generator seeded once before chunk 0
for ``stream/``, seeded right before the call for ``offline/``; ``*_zero`` inject zero noise. The
streams run twice: as the reference computes them (every chunk re-runs the flow over everything)
and through the flow engine (``engine/...``: incremental chunks, the reference's final pass).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import ModelLoadError
from ..models.flow import FlowConfig, flow_from_state_dict
from ..models.hift import HiftConfig, load_hift
from ..token2wav import CosyVoice2Token2Wav, SineNoiseProvider, Token2WavOptions
from . import CaseResult, check, compare, is_cosyvoice3_fixture

SUITE = "cv2_token2wav"
STREAM_FILE, FLOW_CHECKPOINT, HIFT_CHECKPOINT = "token2wav_stream.safetensors", "flow_tiny.pt", "hift_tiny.pt"
FLOW_CONFIG, HIFT_CONFIG = "flow_tiny_config.json", "hift_tiny_config.json"
FLOW_IO, META_FILE = "flow_tiny_io.safetensors", "fixture_meta.json"

FLOW = 1e-4  # flow outputs and what is computed from them before the sine phase (README §2)
SINE = 1e-2  # anything downstream of the HiFT sine phase


def detect(fixture_dir: Path) -> bool:
    return not is_cosyvoice3_fixture(fixture_dir) and \
        all((fixture_dir / f).is_file() for f in (STREAM_FILE, FLOW_CHECKPOINT, HIFT_CHECKPOINT))


def run(fixture_dir: Path) -> list[CaseResult]:
    try:
        t2w = _load(fixture_dir)
    except ModelLoadError as exc:
        return [check(SUITE, "load", False, str(exc))]
    ref = load_file(str(fixture_dir / STREAM_FILE))
    inputs = load_file(str(fixture_dir / FLOW_IO))
    meta = json.loads((fixture_dir / META_FILE).read_text())["token2wav_stream"]
    prompt = (inputs["prompt_token"], inputs["prompt_feat"], inputs["embedding"])
    harmonics = t2w.hift.m_source.num_harmonics

    def zero_noise(length: int) -> torch.Tensor:
        return torch.zeros(1, length, harmonics)

    results: list[CaseResult] = []
    engine = _load(fixture_dir, Token2WavOptions(incremental_stream=True, final="reference"))
    for prefix, noise in (("stream", None), ("stream_zero", zero_noise)):
        if f"{prefix}/waveform" in ref:
            results += _stream_cases(t2w, prefix, prompt, inputs["token"], meta, ref, noise)
            results += _stream_cases(engine, prefix, prompt, inputs["token"], meta, ref, noise, label="engine/")
    results.append(check(SUITE, "engine: no stream left open", engine.open_streams == 0 and
                         engine.engine.open_streams == 0, f"{engine.open_streams} open"))
    for prefix, noise in (("offline", None), ("offline_zero", zero_noise)):
        if f"{prefix}/waveform" in ref:
            generator = torch.Generator().manual_seed(meta["stream_seed"]) if noise is None else None
            wave = t2w.offline(inputs["token"], *prompt, generator=generator, sine_noise=noise)
            results.append(compare(SUITE, f"{prefix}/waveform", wave[None], ref[f"{prefix}/waveform"], rel_l2=SINE))
    results.append(check(SUITE, "no open streams left", t2w.open_streams == 0, f"{t2w.open_streams} open"))
    return results


def _load(fixture_dir: Path, options: Token2WavOptions | None = None) -> CosyVoice2Token2Wav:
    flow_cfg = FlowConfig.from_fixture_json(json.loads((fixture_dir / FLOW_CONFIG).read_text()))
    flow_path = fixture_dir / FLOW_CHECKPOINT
    flow = flow_from_state_dict(flow_cfg, torch.load(flow_path, map_location="cpu", weights_only=True), str(flow_path))
    hift_cfg = HiftConfig.from_fixture_json(json.loads((fixture_dir / HIFT_CONFIG).read_text()))
    hift = load_hift(fixture_dir / HIFT_CHECKPOINT, config=hift_cfg)
    return CosyVoice2Token2Wav(flow, hift, options=options)


def _stream_cases(t2w: CosyVoice2Token2Wav, prefix: str, prompt: tuple[torch.Tensor, ...], tokens: torch.Tensor,
                  meta: dict, ref: dict[str, torch.Tensor], noise: SineNoiseProvider | None,
                  label: str = "") -> list[CaseResult]:
    results = []
    generator = torch.Generator().manual_seed(meta["stream_seed"]) if noise is None else None
    pieces = []
    with t2w.open_stream(*prompt, generator=generator, sine_noise=noise) as stream:
        for i, chunk_meta in enumerate(meta["chunks"]):
            chunk = stream.step_chunk(tokens[:, : chunk_meta["num_tokens"]], chunk_meta["token_offset"],
                                      chunk_meta["finalize"])
            key, name = f"{prefix}/chunk{i}", f"{label}{prefix}/chunk{i}"
            with torch.inference_mode():
                f0 = t2w.hift.f0_predictor(chunk.mel_in)
            results += [
                compare(SUITE, f"{name}/hift_mel_in", chunk.mel_in, ref[f"{key}/hift_mel_in"], rel_l2=FLOW),
                compare(SUITE, f"{name}/f0", f0, ref[f"{key}/f0"], rel_l2=FLOW),
                compare(SUITE, f"{name}/hift_speech", chunk.raw_speech, ref[f"{key}/hift_speech"], rel_l2=SINE),
            ]
            lo, hi = chunk_meta["emitted_range_in_waveform"]
            pieces.append(chunk.audio)
            if chunk.audio.shape[1] != hi - lo:
                results.append(check(SUITE, f"{name}/emitted samples", False, f"{chunk.audio.shape[1]} != {hi - lo}"))
        results.append(check(SUITE, f"{label}{prefix}/stream closed after finalize", stream.closed))
    wave = torch.cat(pieces, dim=1)
    results.append(compare(SUITE, f"{label}{prefix}/waveform", wave, ref[f"{prefix}/waveform"], rel_l2=SINE))
    return results
