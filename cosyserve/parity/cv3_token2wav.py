"""Parity suite "cv3_token2wav": the CosyVoice3 token2wav composition against ``token2wav_stream.safetensors``.

What the reference runtime does per chunk (README §6): the flow re-run over the whole prefix,
the new frames appended to a mel buffer, the vocoder re-run over the whole buffer. We check:

* each recorded flow call's new frames (``token2wav_mel``) and each re-vocoding call (f0, speech);
* :class:`CausalHiftStream` — our incremental vocoder, which vocodes only the new frames and
  carries its state — fed the same mel chunks, against the emitted waveform of the Triton BLS
  composition (block-masked flow), its full-attention variant (what a TensorRT flow computes),
  upstream's python streaming schedule (``cli``) and the zero-noise variant;
* :class:`Cv3FlowStream` — our incremental flow (block masks, per-step cached keys/values of complete
  blocks) — call by call against the reference's block-masked calls (the Triton BLS's non-final
  calls; for the final call the block-masked ``stream_full/mel``, since the reference's final call
  uses full attention);
* the offline path (one flow call, one final vocoder call);
* tokens -> waveform: our flow feeding our incremental vocoder (chaotic in f0, README §2, so
  meaningful only because the flow matches to ~1e-7).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..models.cosyvoice3.config import CausalHiftConfig, Cv3FlowConfig
from ..models.cosyvoice3.flow import CosyVoice3Flow, Cv3FlowStream, load_cosyvoice3_flow
from ..models.cosyvoice3.hift import CausalHiFTGenerator, CausalHiftStream, load_causal_hift
from . import CaseResult, check, compare, is_cosyvoice3_fixture

SUITE = "cv3_token2wav"
STREAM_FILE, FLOW_IO_FILE, META_FILE = "token2wav_stream.safetensors", "flow_tiny_io.safetensors", "fixture_meta.json"
FLOW_FILES = ("flow_tiny.pt", "flow_tiny_config.json")
HIFT_FILES = ("hift_tiny.pt", "hift_tiny_config.json")
FLOW_REL_L2, F0_REL_L2, SINE = 1e-5, 1e-6, 1e-2


def detect(fixture_dir: Path) -> bool:
    return is_cosyvoice3_fixture(fixture_dir) and all(
        (fixture_dir / name).is_file() for name in (STREAM_FILE, FLOW_IO_FILE, META_FILE, *FLOW_FILES, *HIFT_FILES))


class _SilentNoise:
    """Stands in for the fixed noise buffer with zeros (the fixtures' ``*_zero`` variants)."""

    def __init__(self, harmonics: int):
        self.harmonics = harmonics

    def samples(self, stop: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(1, stop, self.harmonics, device=device)


def run(fixture_dir: Path) -> list[CaseResult]:
    flow_cfg = Cv3FlowConfig.from_fixture_json(json.loads((fixture_dir / FLOW_FILES[1]).read_text()))
    flow = load_cosyvoice3_flow(fixture_dir, weights=fixture_dir / FLOW_FILES[0], config=flow_cfg)
    hift_cfg = CausalHiftConfig.from_fixture_json(json.loads((fixture_dir / HIFT_FILES[1]).read_text()))
    hift = load_causal_hift(fixture_dir, config=hift_cfg, weights=fixture_dir / HIFT_FILES[0])
    silent = load_causal_hift(fixture_dir, config=hift_cfg, weights=fixture_dir / HIFT_FILES[0])
    silent.noise = _SilentNoise(silent.m_source.num_harmonics)
    ref, flow_io = load_file(str(fixture_dir / STREAM_FILE)), load_file(str(fixture_dir / FLOW_IO_FILE))
    meta = json.loads((fixture_dir / META_FILE).read_text())["token2wav_stream"]
    chunks, cli_chunks = meta["chunks"], meta.get("cli_chunks", [])
    results = []
    with torch.inference_mode():
        results += _reference_calls(flow, hift, ref, flow_io, chunks)
        results += _incremental_flow(flow, ref, flow_io, chunks)
        stream_mels = [ref[f"stream/chunk{i}/token2wav_mel"] for i in range(len(chunks))]
        results += _incremental(hift, "stream/waveform", stream_mels, chunks, ref, per_chunk=True)
        results += _incremental(silent, "stream_zero/waveform", stream_mels, chunks, ref)
        fullattn = [flow_io[f"chunk{i}/mel_fullattn" if not c["finalize"] else f"chunk{i}/mel"][
                        :, :, 2 * c["token_offset"]:] for i, c in enumerate(chunks)]
        results += _incremental(hift, "stream_fullattn/waveform", fullattn, chunks, ref)
        if cli_chunks:
            results += _cli_flow(flow, ref, flow_io, cli_chunks)
            accumulated = [ref[f"cli/chunk{i}/hift_mel_in"] for i in range(len(cli_chunks))]
            starts = [0] + [m.shape[2] for m in accumulated[:-1]]
            results += _incremental(hift, "cli/waveform", [m[:, :, s:] for m, s in zip(accumulated, starts)],
                                    cli_chunks, ref)
        results += _offline(hift, silent, flow_io, ref)
        results += _tokens_to_waveform(flow, hift, flow_io, chunks, ref)
    return results


def _reference_calls(flow: CosyVoice3Flow, hift: CausalHiFTGenerator, ref: dict, flow_io: dict,
                     chunks: list[dict]) -> list[CaseResult]:
    """The reference runtime's own calls: flow over the prefix (sliced), vocoder over the whole buffer."""
    results = []
    for i, c in enumerate(chunks):
        note = f"tokens={c['num_tokens']} offset={c['token_offset']} finalize={c['finalize']}"
        mel = flow.inference(flow_io["token"][:, :c["num_tokens"]], flow_io["prompt_token"], flow_io["prompt_feat"],
                             flow_io["embedding"], streaming=c["flow_streaming"], finalize=c["finalize"])
        results.append(compare(SUITE, f"stream/chunk{i}/token2wav_mel", mel[:, :, 2 * c["token_offset"]:],
                               ref[f"stream/chunk{i}/token2wav_mel"], rel_l2=FLOW_REL_L2, note=note))
        mel_in = ref[f"stream/chunk{i}/hift_mel_in"]
        results.append(compare(SUITE, f"stream/chunk{i}/f0 (re-vocode)", hift.predict_f0(mel_in, c["finalize"]),
                               ref[f"stream/chunk{i}/f0"], rel_l2=F0_REL_L2))
        speech, source = hift.inference(mel_in, c["finalize"])
        results.append(compare(SUITE, f"stream/chunk{i}/hift_speech (re-vocode)", speech,
                               ref[f"stream/chunk{i}/hift_speech"], rel_l2=SINE, note=f"{mel_in.shape[2]} frames"))
        if f"stream/chunk{i}/hift_source" in ref:
            results.append(compare(SUITE, f"stream/chunk{i}/hift_source", source, ref[f"stream/chunk{i}/hift_source"],
                                   rel_l2=SINE))
    return results


def _incremental_flow(flow: CosyVoice3Flow, ref: dict, flow_io: dict, chunks: list[dict]) -> list[CaseResult]:
    """Cv3FlowStream fed the Triton schedule's new tokens; each call's new frames against the reference."""
    stream = Cv3FlowStream(flow, flow_io["prompt_token"], flow_io["prompt_feat"], flow_io["embedding"])
    results, received = [], 0
    for i, c in enumerate(chunks):
        mel = stream.push(flow_io["token"][:, received:c["num_tokens"]], c["finalize"])
        received = c["num_tokens"]
        if c["finalize"]:
            key, expected = f"stream_full/mel[-{mel.shape[2]}:]", flow_io["stream_full/mel"][:, :, -mel.shape[2]:]
        else:
            key, expected = f"stream/chunk{i}/token2wav_mel", ref[f"stream/chunk{i}/token2wav_mel"]
        results.append(compare(SUITE, f"{key} incremental flow", mel, expected, rel_l2=FLOW_REL_L2,
                               note=f"committed {stream.committed} frames"))
    return results


def _cli_flow(flow: CosyVoice3Flow, ref: dict, flow_io: dict, chunks: list[dict]) -> list[CaseResult]:
    """Upstream's python schedule (first hop aligned to the 50-frame blocks): the accumulated mel of each
    call, from our flow re-run over the prefix and from the incremental flow (non-final calls; the final
    call of that schedule uses full attention)."""
    stream = Cv3FlowStream(flow, flow_io["prompt_token"], flow_io["prompt_feat"], flow_io["embedding"])
    results, accumulated, received = [], [], 0
    for i, c in enumerate(chunks):
        tokens = flow_io["token"][:, :c["num_tokens"]]
        mel = flow.inference(tokens, flow_io["prompt_token"], flow_io["prompt_feat"], flow_io["embedding"],
                             streaming=c["flow_streaming"], finalize=c["finalize"])
        accumulated.append(mel[:, :, 2 * c["token_offset"]:])
        expected = ref[f"cli/chunk{i}/hift_mel_in"]
        results.append(compare(SUITE, f"cli/chunk{i}/hift_mel_in (flow)", torch.cat(accumulated, dim=2), expected,
                               rel_l2=FLOW_REL_L2))
        if c["flow_streaming"]:
            new = stream.push(flow_io["token"][:, received:c["num_tokens"]], c["finalize"])
            results.append(compare(SUITE, f"cli/chunk{i} incremental flow", new, expected[:, :, -new.shape[2]:],
                                   rel_l2=FLOW_REL_L2, note=f"committed {stream.committed} frames"))
        received = c["num_tokens"]
    return results


def _incremental(hift: CausalHiFTGenerator, key: str, mels: list[torch.Tensor], chunks: list[dict], ref: dict, *,
                 per_chunk: bool = False) -> list[CaseResult]:
    """Feed the new mel frames of each call to one CausalHiftStream; compare what it emits."""
    stream = CausalHiftStream(hift)
    pieces = [stream.push(mel, c["finalize"]) for mel, c in zip(mels, chunks)]
    waveform = ref[key]
    results = []
    if per_chunk:
        for i, (piece, c) in enumerate(zip(pieces, chunks)):
            lo, hi = c["emitted_range_in_waveform"]
            results.append(compare(SUITE, f"{key}[{lo}:{hi}] incremental", piece,
                                   waveform[:, lo:hi], rel_l2=SINE))
    results.append(compare(SUITE, f"{key} incremental", torch.cat(pieces, dim=1), waveform, rel_l2=SINE,
                           note=f"pieces {[p.shape[1] for p in pieces]}"))
    return results


def _offline(hift: CausalHiFTGenerator, silent: CausalHiFTGenerator, flow_io: dict, ref: dict) -> list[CaseResult]:
    mel = flow_io["nonstream/mel"]
    results = [compare(SUITE, "offline/f0", hift.predict_f0(mel, True), ref["offline/f0"], rel_l2=F0_REL_L2),
               compare(SUITE, "offline/waveform", hift.inference(mel, True)[0], ref["offline/waveform"], rel_l2=SINE)]
    if "offline_zero/waveform" in ref:
        results.append(compare(SUITE, "offline_zero/waveform", silent.inference(mel, True)[0],
                               ref["offline_zero/waveform"], rel_l2=SINE))
    return results


def _tokens_to_waveform(flow: CosyVoice3Flow, hift: CausalHiFTGenerator, flow_io: dict, chunks: list[dict],
                        ref: dict) -> list[CaseResult]:
    """Our flow (re-run over the prefix, as the reference) feeding our incremental vocoder."""
    stream = CausalHiftStream(hift)
    pieces = []
    for c in chunks:
        mel = flow.inference(flow_io["token"][:, :c["num_tokens"]], flow_io["prompt_token"], flow_io["prompt_feat"],
                             flow_io["embedding"], streaming=c["flow_streaming"], finalize=c["finalize"])
        pieces.append(stream.push(mel[:, :, 2 * c["token_offset"]:], c["finalize"]))
    waveform = torch.cat(pieces, dim=1)
    per_token = waveform.shape[1] == 2 * hift.hop_length * flow_io["token"].shape[1]
    return [compare(SUITE, "tokens -> stream/waveform (ours)", waveform, ref["stream/waveform"],
                    rel_l2=SINE),
            check(SUITE, "960 samples per token", per_token, f"{waveform.shape[1]} samples")]
