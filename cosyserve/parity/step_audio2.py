"""Parity suite "step_audio2": Step-Audio-2-mini's token2wav (its DiT flow and HiFT) against the
reference's tiny-model vectors.

Fixture format: ``shared/parity/dit/README.md``. Everything is derived from the directory
(config JSON, manifest metadata, tensor files), never from the shared copy's values.

Tolerances. Integers (chunk plans, noise offsets, cache lengths, sample counts) are exact.
A float tensor with a reference fp32-vs-fp64 deviation ``d`` (``manifest.json →
fp32_vs_fp64_max_abs``) must agree within max-abs ``min(cap, max(10·d, 1e-5))``: two fp32
implementations differ by about 2·d, and the cap is the README's acceptance for that class
(1e-4 for unit intermediates, mu, spk_proj and caches; 2e-4 for flow mels). Waveforms use the
README's criterion (max-abs 5e-3 and RMS(err) ≤ 3 % of RMS(ref)): the harmonic phase of HiFT
amplifies fp32 rounding. HiFT unit: f0 1e-3 Hz, source 1e-4, speech 1e-3.

Deliberate deviation: the reference's batched offline path leaks padding into shorter items
(README surprise 5). We require single-request behaviour, so padded items are compared with the
reference's single-run output where it exists, and with our own single run otherwise.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

from cosyserve.config import dump_hyperpyyaml, load_hyperpyyaml
from cosyserve.errors import ModelLoadError
from cosyserve.models.step_audio2.config import StepAudio2FlowConfig
from cosyserve.models.step_audio2.encoder_v2 import relative_position_table
from cosyserve.models.step_audio2.flow import StepAudio2Flow, load_step_audio2_flow_state_dict
from cosyserve.models.hift import HiftConfig, load_hift
from cosyserve.parity import CaseResult, check, compare
from cosyserve.schedule import plan_stream_chunks
from cosyserve.token2wav.step_audio2 import (OfflineRequest, StepAudio2Models, StepAudio2Stream, VoicePrompt,
                                             VoiceState, build_voice_state, offline_waveforms)
from cosyserve.token2wav.vocoder_stream import HiftStream

SUITE = "step_audio2"
UNIT_CAP, MEL_CAP = 1e-4, 2e-4
WAVE = {"max_abs": 5e-3, "rel_l2": 0.03}
BATCH_INVARIANCE = 1e-5  # our batched vs our single run: only op-order noise allowed


def detect(fixture_dir: Path) -> bool:
    return all((Path(fixture_dir) / name).is_file()
               for name in ("tiny_flow.pt", "manifest.json", "unit_estimator.safetensors"))


class _Fixture:
    def __init__(self, root: Path):
        self.root = root
        manifest = json.loads((root / "manifest.json").read_text())
        self.meta = manifest["meta"]
        self.dev = manifest.get("fp32_vs_fp64_max_abs", {})
        self.config = json.loads((root / "tiny_config.json").read_text())

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Tensors of ``<name>.safetensors`` keyed without the ``<name>.`` prefix."""
        data = load_file(str(self.root / f"{name}.safetensors"))
        return {k[len(name) + 1:] if k.startswith(name + ".") else k: v for k, v in data.items()}

    def tol(self, key: str, cap: float) -> float:
        deviation = self.dev.get(key, {}).get("max_abs", 0.0)
        return min(cap, max(10 * deviation, 1e-5))

    def cmp(self, case: str, got: torch.Tensor, ref: torch.Tensor, key: str, cap: float = UNIT_CAP, note: str = "") -> CaseResult:
        return compare(SUITE, case, got, ref, max_abs=self.tol(key, cap), note=note)


def _wave(case: str, got: torch.Tensor, ref: torch.Tensor, note: str = "") -> CaseResult:
    return compare(SUITE, case, got, ref, note=note, **WAVE)


def _exact(case: str, got, ref) -> CaseResult:
    return check(SUITE, case, got == ref, "" if got == ref else f"got {got}, reference {ref}")


@contextlib.contextmanager
def _capture(module: torch.nn.Module, pre: bool = False):
    """Collect a module's outputs (or first inputs with ``pre``) while the context is open."""
    seen: list = []
    if pre:
        handle = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    else:
        handle = module.register_forward_hook(lambda _m, _args, out: seen.append(out))
    try:
        yield seen
    finally:
        handle.remove()


# ---------------------------------------------------------------------------------- models
@dataclass
class _Models:
    """The tiny flow and HiFT, and HiFT's recorded harmonic-source noise for every call."""

    models: StepAudio2Models
    sine_noise: Callable[[int], torch.Tensor]

    @property
    def hift(self):
        return self.models.hift


def _load_models(fx: _Fixture, results: list[CaseResult]) -> tuple[StepAudio2Flow, _Models]:
    cfg = StepAudio2FlowConfig.from_fixture_json(fx.config)
    flow = StepAudio2Flow(cfg).eval()
    try:
        load_step_audio2_flow_state_dict(flow, fx.root / "tiny_flow.pt")
        results.append(check(SUITE, "load tiny_flow.pt (strict)", True, f"{len(flow.state_dict())} tensors"))
    except ModelLoadError as exc:
        results.append(check(SUITE, "load tiny_flow.pt (strict)", False, str(exc)[:200]))
    noise = load_file(str(fx.root / "noise.safetensors"))
    stored = noise["rand_noise"]
    flow.decoder.rand_noise[:, :, : stored.shape[2]] = stored  # frames past the stored ones are never read
    sine_noise = noise["hift_sine_noise"].float()
    hift = load_hift(fx.root / "tiny_hift.pt", config=HiftConfig.from_fixture_json(fx.config["hift_hparams"]))
    return flow, _Models(StepAudio2Models(flow, hift), lambda samples: sine_noise[:, :samples])


def _config_cases(fx: _Fixture) -> list[CaseResult]:
    """tiny_config's YAML == its JSON hyper-parameters; to_yaml_node round-trips; real YAML == real()."""
    results = []
    tiny = StepAudio2FlowConfig.from_fixture_json(fx.config)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "flow.yaml"
        path.write_text(fx.config["flow_yaml"])
        results.append(_exact("config: tiny flow.yaml == JSON", StepAudio2FlowConfig.from_yaml_tree(load_hyperpyyaml(path)), tiny))
        dump_hyperpyyaml({"flow": tiny.to_yaml_node()}, path)
        results.append(_exact("config: to_yaml_node round trip", StepAudio2FlowConfig.from_yaml_tree(load_hyperpyyaml(path)), tiny))
        real_manifest = fx.root / "dit_flow_real_manifest.json"
        if real_manifest.is_file():
            path.write_text(json.loads(real_manifest.read_text())["flow_yaml"])
            results.append(_exact("config: real flow.yaml == real()",
                                  StepAudio2FlowConfig.from_yaml_tree(load_hyperpyyaml(path)), StepAudio2FlowConfig.real()))
    return results


def _real_manifest_cases(fx: _Fixture) -> list[CaseResult]:
    path = fx.root / "dit_flow_real_manifest.json"
    if not path.is_file():
        return []
    manifest = json.loads(path.read_text())
    with torch.device("meta"):  # shapes only: no 600 MB allocation
        flow = StepAudio2Flow(StepAudio2FlowConfig.real())
    state = flow.state_dict()
    ours = [(k, list(v.shape)) for k, v in state.items()]
    ref = [(k["key"], k["shape"]) for k in manifest["keys"]]
    results = [
        check(SUITE, "real flow: state-dict keys + shapes", ours == ref,
              f"{len(ours)} tensors" if ours == ref else f"ours {len(ours)}, reference {len(ref)}; "
              f"first difference {next((a, b) for a, b in zip(ours + [None] * len(ref), ref) if a != b)}"),
        _exact("real flow: parameter count", sum(v.numel() for v in state.values()), manifest["n_params"]),
    ]
    buffers = {name: list(buf.shape) for name, buf in flow.named_buffers() if name not in state}
    for entry in manifest.get("non_persistent_buffers", []):
        if entry["name"].endswith("dummy_buffer"):
            continue  # upstream placeholder that no computation reads
        results.append(_exact(f"real flow: buffer {entry['name']}", buffers.get(entry["name"]), entry["shape"]))
    return results


# ---------------------------------------------------------------------------------- units
def _estimator_cases(fx: _Fixture, flow: StepAudio2Flow) -> list[CaseResult]:
    est, u = flow.decoder.estimator, fx.tensors("unit_estimator")
    results = []
    full = {k[len("unit_est_full."):]: v for k, v in u.items() if k.startswith("unit_est_full.")}
    valid = full["mask"][:, 0].bool()  # padded query frames carry no meaning
    with contextlib.ExitStack() as stack:
        t_emb = stack.enter_context(_capture(est.t_embedder))
        in_proj = stack.enter_context(_capture(est.in_proj))
        blocks = [stack.enter_context(_capture(block)) for block in est.blocks]
        out = est(full["x"], full["mask"], full["mu"], full["t"], full["spks"], full["cond"])
    results.append(fx.cmp("unit_est_full t_emb", t_emb[0], full["t_emb"], "unit_est_full.t_emb"))
    results.append(fx.cmp("unit_est_full in_proj_out", in_proj[0], full["in_proj_out"], "unit_est_full.in_proj_out"))
    for i, seen in enumerate(blocks):
        key = f"block{i}_out"
        if key in full:
            results.append(fx.cmp(f"unit_est_full {key} (valid)", seen[0][0][valid], full[key][valid], f"unit_est_full.{key}"))
    results.append(fx.cmp("unit_est_full out (valid frames)", out.transpose(1, 2)[valid],
                          full["out"].transpose(1, 2)[valid], "unit_est_full.out"))

    c = {k[len("unit_est_chunk."):]: v for k, v in u.items() if k.startswith("unit_est_chunk.")}
    args = (c["x"], c["mu"], c["t"], c["spks"], c["cond"])
    runs = {"": est.forward_chunk(*args, c["cnn_cache"], c["att_cache"]),
            "_nocache": est.forward_chunk(*args, *est.empty_caches(c["x"].shape[0], c["x"].device, c["x"].dtype))}
    for suffix, (v, cnn, att) in runs.items():
        for name, got in (("out", v), ("new_cnn_cache", cnn), ("new_att_cache", att)):
            key = name + suffix
            results.append(fx.cmp(f"unit_est_chunk {key}", got, c[key], f"unit_est_chunk.{key}"))
    return results


def _encoder_cases(fx: _Fixture, flow: StepAudio2Flow) -> list[CaseResult]:
    enc, u = flow.encoder, fx.tensors("unit_encoder")
    full = {k[len("unit_enc_full."):]: v for k, v in u.items() if k.startswith("unit_enc_full.")}
    lens = full["token_lens"].long()
    results = []
    # Intermediates are compared on the unpadded rows: the reference leaks padding into the others.
    full_rows = lens == full["tokens"].shape[1]
    with contextlib.ExitStack() as stack:
        embed = stack.enter_context(_capture(enc.embed))
        lookahead = stack.enter_context(_capture(enc.pre_lookahead_layer))
        encoders = stack.enter_context(_capture(enc.up_layer, pre=True))
        up_layer = stack.enter_context(_capture(enc.up_layer))
        up_embed = stack.enter_context(_capture(enc.up_embed))
        up_encoders = stack.enter_context(_capture(enc.after_norm, pre=True))
        out, mask = enc(full["emb_masked"], lens)
    results.append(_exact("unit_enc_full out_mask", mask.int().tolist(), full["out_mask"].tolist()))
    pos = relative_position_table(full["tokens"].shape[1], enc.cfg.output_size, out.device, out.dtype)
    results.append(fx.cmp("unit_enc_full pos_emb", pos, full["pos_emb"], "unit_enc_full.pos_emb"))
    seen = {"embed_out": embed[0], "pre_lookahead_out": lookahead[0], "encoders_out": encoders[0],
            "up_layer_out": up_layer[0].transpose(1, 2), "up_embed_out": up_embed[0],
            "up_encoders_out": up_encoders[0], "out": out}
    for name, got in seen.items():
        results.append(fx.cmp(f"unit_enc_full {name} (unpadded rows)", got[full_rows], full[name][full_rows],
                              f"unit_enc_full.{name}"))
    proj = flow.encoder_proj(out)
    results.append(fx.cmp("unit_enc_full proj_out (unpadded rows)", proj[full_rows], full["proj_out"][full_rows],
                          "unit_enc_full.proj_out"))
    for row in torch.nonzero(~full_rows).flatten().tolist():
        n = int(lens[row])
        alone, _ = enc(full["emb_masked"][row:row + 1, :n], lens[row:row + 1])
        results.append(compare(SUITE, f"unit_enc_full row {row}: batched == alone", out[row:row + 1, : 2 * n], alone,
                               max_abs=BATCH_INVARIANCE, note="ours; reference batch leaks padding"))

    chunk = {k[len("unit_enc_chunk."):]: v for k, v in u.items() if k.startswith("unit_enc_chunk.")}
    cache = enc.empty_cache(out.device, out.dtype)
    for i, step in enumerate(fx.meta["unit_enc_chunk_plan"]):
        start, end = step["tokens"]
        emb = flow.input_embedding(chunk["tokens"][:, start:end].long())
        got, cache = enc.forward_chunk(emb, step["last_chunk"], cache)
        cnn, att = cache.to_reference(enc.cfg.up_rate)
        for name, value in (("out", got), ("new_cnn_cache", cnn), ("new_att_cache", att)):
            key = f"chunk{i}.{name}"
            results.append(fx.cmp(f"unit_enc_chunk {key}", value, chunk[key], f"unit_enc_chunk.{key}"))
    return results


def _hift_cases(fx: _Fixture, runtime: _Models) -> list[CaseResult]:
    hift, u = runtime.hift, fx.tensors("unit_hift")
    results = []
    for call in sorted({k.split(".")[0] for k in u}):
        mel = u[f"{call}.mel"]
        cache = u.get(f"{call}.cache_source")
        f0 = hift.f0_predictor(mel)
        speech, source = hift.inference(mel, cache, sine_noise=runtime.sine_noise(mel.shape[2] * hift.hop_length))
        results.append(compare(SUITE, f"unit_hift {call} f0", f0, u[f"{call}.f0"], max_abs=1e-3))
        results.append(compare(SUITE, f"unit_hift {call} source", source, u[f"{call}.source"], max_abs=1e-4))
        results.append(compare(SUITE, f"unit_hift {call} speech", speech, u[f"{call}.speech"], max_abs=1e-3))
    return results


# ---------------------------------------------------------------------------------- offline
def _offline_cases(fx: _Fixture, name: str, flow: StepAudio2Flow, runtime: _Models) -> list[CaseResult]:
    t, items = fx.tensors(name), fx.meta[name]["items"]
    lens, mel_lens = t["flow_token_lens"].long(), t["prompt_mel_lens"].long()
    unpadded = [int(n) == t["flow_tokens"].shape[1] for n in lens]
    results = []
    spk = flow.project_speaker(t["spk_emb"])
    mu, _ = flow.encode(t["flow_tokens"].long(), lens)
    mels, frame_lens = flow.inference(t["flow_tokens"].long(), lens, t["prompt_mel"], mel_lens, t["spk_emb"], t["z"])
    results.append(fx.cmp(f"{name} spk_proj", spk, t["spk_proj"], f"{name}.spk_proj"))
    results.append(_exact(f"{name} out_mel_lens", frame_lens.tolist(), t["out_mel_lens"].tolist()))
    requests, alone_mels = [], []
    for i, item in enumerate(items):
        n, frames, prompt_tokens = int(lens[i]), int(frame_lens[i]), item["prompt_tokens"]
        tokens = t["flow_tokens"][i, :n]
        requests.append(OfflineRequest(tokens[prompt_tokens:], VoicePrompt(
            tokens[:prompt_tokens], t["prompt_mel"][i, : int(mel_lens[i])], t["spk_emb"][i])))
        if unpadded[i]:
            results.append(fx.cmp(f"{name} item{i} mu", mu[i], t["mu"][i], f"{name}.mu"))
            results.append(fx.cmp(f"{name} item{i} out_mel", mels[i, :, :frames], t["out_mel"][i, :, :frames],
                                  f"{name}.out_mel", MEL_CAP))
        if len(items) > 1:
            alone, _ = flow.inference(t["flow_tokens"][i:i + 1, :n].long(), lens[i:i + 1],
                                      t["prompt_mel"][i:i + 1], mel_lens[i:i + 1], t["spk_emb"][i:i + 1], t["z"][i:i + 1])
            alone_mels.append(alone)
            results.append(compare(SUITE, f"{name} item{i} batched == alone (ours)", mels[i:i + 1, :, :frames], alone,
                                   max_abs=BATCH_INVARIANCE))
        ref_alone = t.get(f"item{i}_alone_out_mel")
        if ref_alone is not None:
            results.append(fx.cmp(f"{name} item{i} out_mel vs ref single run", mels[i:i + 1, :, :frames], ref_alone,
                                  f"{name}.item{i}_alone_out_mel", MEL_CAP))
    waves = offline_waveforms(runtime.models, requests, noise=[t["z"][i:i + 1] for i in range(len(items))],
                              sine_noise=runtime.sine_noise)
    for i, item in enumerate(items):
        results.append(_exact(f"{name} item{i} samples", waves[i].numel(), item["wav_samples"]))
        ref_wave = t[f"item{i}.wav"][0]
        start, end = int(mel_lens[i]), int(frame_lens[i])
        if unpadded[i]:
            results.append(_wave(f"{name} item{i} wav", waves[i], ref_wave))
            continue
        # The stored wav was vocoded from the leaky batched mel: check our vocoder path on that mel,
        # and our wav against the same vocoder on the reference's single-run mel.
        noise = runtime.sine_noise((end - start) * runtime.hift.hop_length)
        from_batched = runtime.hift.inference(t["out_mel"][i:i + 1, :, start:end], sine_noise=noise)[0][0]
        results.append(_wave(f"{name} item{i} vocoder on ref batched mel", from_batched, ref_wave))
        ref_alone = t.get(f"item{i}_alone_out_mel")
        if ref_alone is not None:
            expected = runtime.hift.inference(ref_alone[:, :, start:end], sine_noise=noise)[0][0]
            results.append(_wave(f"{name} item{i} wav vs ref single-run mel", waves[i], expected))
    return results


# ---------------------------------------------------------------------------------- streaming
def _speaker_prompt(fx: _Fixture, setup_mel: torch.Tensor) -> VoicePrompt:
    """The prompt whose mel starts with the setup's aligned mel."""
    prompts = fx.tensors("prompts")
    for name in sorted({k.split(".")[0] for k in prompts}):
        mel = prompts.get(f"{name}.mel_24k")
        if mel is not None and mel.shape[1] >= setup_mel.shape[1] and torch.equal(mel[:, : setup_mel.shape[1]], setup_mel):
            return VoicePrompt(prompts[f"{name}.tokens"], mel[0], prompts[f"{name}.spk_emb"][0])
    raise ValueError("no prompt in prompts.safetensors matches stream_setup.setup_mel")


def _setup_cases(fx: _Fixture, flow: StepAudio2Flow) -> tuple[list[CaseResult], VoiceState]:
    """The voice state of the streams' prompt, and its cases."""
    s, meta = fx.tensors("stream_setup"), fx.meta["stream_setup"]
    prompt = _speaker_prompt(fx, s["setup_mel"])
    state = build_voice_state(flow, prompt)
    results = [
        _exact("stream_setup P (aligned frames)", state.prompt_frames, meta["P"]),
        fx.cmp("stream_setup spk_proj", state.spk_proj, s["spk_proj"], "stream_setup.spk_proj"),
    ]
    n = state.prompt_frames // flow.up_rate
    lookahead = torch.as_tensor(prompt.tokens)[:flow.pre_lookahead_len]
    results.append(_exact("stream_setup setup_tokens", torch.cat([torch.as_tensor(prompt.tokens)[:n], lookahead]).tolist(),
                          s["setup_tokens"][0].tolist()))
    with _capture(flow.encoder_proj) as mu:
        mel, _ = flow.setup_stream(s["setup_tokens"][:, :n].long(), s["setup_mel"], state.spk_proj)
    results.append(fx.cmp("stream_setup setup_mu", mu[0].transpose(1, 2), s["setup_mu"], "stream_setup.setup_mu"))
    results.append(fx.cmp("stream_setup setup_out_mel", mel, s["setup_out_mel"], "stream_setup.setup_out_mel", MEL_CAP))
    cnn, att = state.flow_cache.encoder.to_reference(flow.up_rate)
    caches = {"conformer_cnn_cache": cnn, "conformer_att_cache": att,
              "estimator_cnn_cache": state.flow_cache.estimator.cnn, "estimator_att_cache": state.flow_cache.estimator.att}
    for name, got in caches.items():
        results.append(fx.cmp(f"stream_setup cache.{name}", got, s[f"cache.{name}"], f"stream_setup.cache.{name}"))
    return results, state


def _snapshot(state) -> list[torch.Tensor]:
    cache = state.flow_cache
    return [t.clone() for t in (state.spk_proj, cache.encoder.lookahead, cache.encoder.upsample,
                                cache.encoder.token_att, cache.encoder.frame_att, cache.estimator.cnn, cache.estimator.att)]


def _stream_cases(fx: _Fixture, name: str, flow: StepAudio2Flow, runtime: _Models, state: VoiceState) -> list[CaseResult]:
    t, meta = fx.tensors(name), fx.meta["streams"][name]
    target = t["target_tokens"].long()
    plan = plan_stream_chunks(target.numel(), meta["strategy"], flow.pre_lookahead_len)
    ref_plan = [(c["token_range"][0], c["token_range"][1], c["last_chunk"]) for c in meta["chunks"]]
    results = [_exact(f"{name} chunk plan ({meta['strategy']})", [(c.start, c.end, c.last) for c in plan], ref_plan)]
    before = _snapshot(state)
    stream = StepAudio2Stream(runtime.models, state, sine_noise=runtime.sine_noise)
    mels, waves = [], []
    for chunk, ref in zip(plan, meta["chunks"]):
        tag = f"{name} c{ref['index']:02d}"
        key = f"chunk{ref['index']:02d}"
        tokens = target[chunk.start:chunk.end]
        results.append(_exact(f"{tag} tokens", tokens.tolist(), t[f"{key}.tokens"].tolist()))
        with _capture(flow.encoder_proj) as mu:
            res = stream.step_chunk(tokens, chunk.last)
        mels.append(res.mel)
        waves.append(res.audio)
        counts = {"noise_offset": res.noise_offset, "mel_frames": res.mel.shape[2],
                  "T_att_after_trim": res.cache.estimator.frames, "conformer_att_len_after": res.cache.encoder.frames,
                  "emitted_samples": res.audio.shape[1]}
        results.append(_exact(f"{tag} offsets/lengths/samples", counts, {k: ref[k] for k in counts}))
        results.append(fx.cmp(f"{tag} mu", mu[0].transpose(1, 2), t[f"{key}.mu"], f"{name}.{key}.mu"))
        results.append(fx.cmp(f"{tag} mel", res.mel, t[f"{key}.mel"], f"{name}.{key}.mel", MEL_CAP))
        probe = res.cache.estimator.att[0, 0, 0, 0]  # ODE step 0, block 0, conditional row, head 0
        results.append(fx.cmp(f"{tag} est_att probe (post-trim)", probe, t[f"{key}.est_att_probe_post_trim"],
                              f"{name}.{key}.est_att_probe_post_trim"))
        if f"{key}.hift_speech_raw" in t:
            results.append(_wave(f"{tag} hift_speech_raw", res.vocoder.raw_speech, t[f"{key}.hift_speech_raw"]))
            results.append(_wave(f"{tag} hift_source", res.vocoder.source, t[f"{key}.hift_source"]))
        results.append(_wave(f"{tag} wav", res.audio, t[f"{key}.wav"]))
    results.append(check(SUITE, f"{name} request state released",
                         stream.closed and stream.cache is None))
    after = _snapshot(state)
    results.append(check(SUITE, f"{name} voice state unchanged", all(torch.equal(a, b) for a, b in zip(before, after))))
    results.append(fx.cmp(f"{name} mel_concat", torch.cat(mels, dim=2), t["mel_concat"], f"{name}.mel_concat", MEL_CAP))
    results.append(_wave(f"{name} wav_concat", torch.cat(waves, dim=1), t["wav_concat"]))
    # The vocoder alone, fed the reference's chunk mels: isolates HiFT streaming from flow error.
    vocoder = HiftStream(runtime.hift, sine_noise=runtime.sine_noise)
    pieces = [vocoder.push(t[f"chunk{ref['index']:02d}.mel"], finalize=ref["last_chunk"]).audio for ref in meta["chunks"]]
    results.append(_wave(f"{name} vocoder-only wav_concat", torch.cat(pieces, dim=1), t["wav_concat"]))
    return results


@torch.inference_mode()
def run(fixture_dir: Path) -> list[CaseResult]:
    fx = _Fixture(Path(fixture_dir))
    results = _config_cases(fx) + _real_manifest_cases(fx)
    flow, runtime = _load_models(fx, results)
    results += _estimator_cases(fx, flow)
    results += _encoder_cases(fx, flow)
    results += _hift_cases(fx, runtime)
    for name in sorted(k for k, v in fx.meta.items() if k.startswith("offline_") and isinstance(v, dict)):
        results += _offline_cases(fx, name, flow, runtime)
    setup, state = _setup_cases(fx, flow)
    results += setup
    for name in fx.meta["streams"]:
        results += _stream_cases(fx, name, flow, runtime, state)
    return results
