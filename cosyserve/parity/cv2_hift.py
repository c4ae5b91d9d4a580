"""Parity suite "cv2_hift": the CosyVoice2 HiFT vocoder against ``hift_tiny_io.safetensors``.

Order follows the fixture README (§5.1): F0 from the mel, decode-only from the stored
excitation (tight), excitation from the mel with injected noise (loose: float32 phase
accumulation), end to end with a seeded generator, then loading checks incl. the real-size manifest.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import ModelLoadError
from ..models.hift import HiFTGenerator, HiftConfig, SourceNoise, draw_source_noise, load_hift, load_hift_state_dict
from . import CaseResult, check, compare, is_cosyvoice3_fixture

SUITE = "cv2_hift"
CHECKPOINT, IO_FILE, CONFIG_FILE = "hift_tiny.pt", "hift_tiny_io.safetensors", "hift_tiny_config.json"
MANIFEST_FILE, META_FILE = "hift_real_manifest.json", "fixture_meta.json"

TIGHT = 1e-5  # f0, decode-only, conv_post (README §2)
SINE = 1e-2  # anything downstream of the float32 sine phase


def detect(fixture_dir: Path) -> bool:
    return not is_cosyvoice3_fixture(fixture_dir) and (fixture_dir / CHECKPOINT).is_file() and \
        (fixture_dir / IO_FILE).is_file()


def run(fixture_dir: Path) -> list[CaseResult]:
    cfg = HiftConfig.from_fixture_json(json.loads((fixture_dir / CONFIG_FILE).read_text()))
    results: list[CaseResult] = []
    try:
        model = load_hift(fixture_dir / CHECKPOINT, config=cfg, fold_weight_norm=False)
        results.append(check(SUITE, "load/strict", True, f"{len(model.state_dict())} tensors"))
    except ModelLoadError as exc:
        return [check(SUITE, "load/strict", False, str(exc))]
    io = load_file(str(fixture_dir / IO_FILE))
    seeds = _seeds(fixture_dir)
    with torch.inference_mode():
        results += _component_cases(model, io)
        results += _end_to_end_cases(model, io, seeds)
        folded = load_hift(fixture_dir / CHECKPOINT, config=cfg, fold_weight_norm=True)
        mel, source = io["a/mel"], io["a/source"]
        results.append(compare(SUITE, "folded_weight_norm/a/decode_speech", folded.decode(mel, source),
                               model.decode(mel, source), max_abs=1e-6, note="vs. parametrized model"))
    if (fixture_dir / MANIFEST_FILE).is_file():
        results += _manifest_cases(json.loads((fixture_dir / MANIFEST_FILE).read_text()))
    return results


def _cases(io: dict) -> list[str]:
    """Seeded cases present in the file (a, b, ...): those with a stored mel."""
    return sorted(k.split("/")[0] for k in io if k.endswith("/mel"))


def _seeds(fixture_dir: Path) -> dict[str, int]:
    meta_path = fixture_dir / META_FILE
    if not meta_path.is_file():
        return {}
    return json.loads(meta_path.read_text()).get("hift_io", {}).get("seeds", {})


def _cache(io: dict, case: str) -> torch.Tensor | None:
    return io.get(f"{case}/cache_source")


def _paste_cache(source: torch.Tensor, cache: torch.Tensor | None) -> torch.Tensor:
    if cache is not None:
        source = source.clone()
        source[:, :, : cache.shape[-1]] = cache
    return source


def _component_cases(model: HiFTGenerator, io: dict) -> list[CaseResult]:
    results = []
    harmonics = model.m_source.num_harmonics
    for case in _cases(io):
        mel = io[f"{case}/mel"]
        f0 = model.f0_predictor(mel)
        results.append(compare(SUITE, f"{case}/f0", f0, io[f"{case}/f0"], rel_l2=TIGHT))
        results.append(compare(SUITE, f"{case}/decode_speech (stored source)", model.decode(mel, io[f"{case}/source"]),
                               io[f"{case}/speech"], rel_l2=TIGHT))
        if f"{case}/conv_post_out" in io:
            spectrum = model.predict_spectrum(mel, io[f"{case}/source"])
            results.append(compare(SUITE, f"{case}/conv_post_out (stored source)", spectrum,
                                   io[f"{case}/conv_post_out"], rel_l2=TIGHT))
        noise = SourceNoise(io[f"{case}/rng_rand_ini"], io[f"{case}/rng_sine_noise"])
        # From the stored F0 the source is isolated from F0 rounding; from our F0 it is the real path.
        for label, f0_in in (("stored f0", io[f"{case}/f0"]), ("own f0", f0)):
            source = _paste_cache(model.compute_source(f0_in, noise), _cache(io, case))
            results.append(compare(SUITE, f"{case}/source (injected draws, {label})", source,
                                   io[f"{case}/source"], rel_l2=SINE))
        zero_case = f"{case}_zero"
        if f"{zero_case}/source" in io:
            zeros = SourceNoise.zeros(1, mel.shape[2] * model.hop_length, harmonics, mel.device)
            source = _paste_cache(model.compute_source(f0, zeros), _cache(io, zero_case))
            results.append(compare(SUITE, f"{zero_case}/source", source, io[f"{zero_case}/source"], rel_l2=SINE))
    return results


def _end_to_end_cases(model: HiFTGenerator, io: dict, seeds: dict[str, int]) -> list[CaseResult]:
    results = []
    harmonics = model.m_source.num_harmonics
    for case in _cases(io):
        mel = io[f"{case}/mel"]
        length = mel.shape[2] * model.hop_length
        if case in seeds:
            draws = draw_source_noise(1, length, harmonics, "cpu", torch.Generator().manual_seed(seeds[case]))
            same = torch.equal(draws.sine_noise, io[f"{case}/rng_sine_noise"]) and torch.equal(
                draws.initial_phase[:, 1:], io[f"{case}/rng_rand_ini"][:, 1:])
            results.append(check(SUITE, f"{case}/rng_draws (seed {seeds[case]})", same, "" if same else "draws differ"))
            generator = torch.Generator().manual_seed(seeds[case])
            speech, source = model.inference(mel, _cache(io, case), generator=generator)
            for name, got in (("speech", speech), ("source", source)):
                results.append(compare(SUITE, f"{case}/{name} (seeded end to end)", got, io[f"{case}/{name}"],
                                       rel_l2=SINE))
        zero_case = f"{case}_zero"
        if f"{zero_case}/speech" in io:
            speech, _ = model.inference(mel, _cache(io, zero_case), sine_noise=torch.zeros(1, length, harmonics))
            results.append(compare(SUITE, f"{zero_case}/speech (zero noise end to end)", speech,
                                   io[f"{zero_case}/speech"], rel_l2=SINE))
    return results


def _manifest_cases(manifest: dict) -> list[CaseResult]:
    cfg = HiftConfig.from_fixture_json(manifest)
    results = [check(SUITE, "real/config == HiftConfig.real()", cfg == HiftConfig.real(),
                     "" if cfg == HiftConfig.real() else f"manifest config {cfg}")]
    model = HiFTGenerator(cfg)
    ours = [(k, list(v.shape)) for k, v in model.state_dict().items()]
    theirs = [(k["name"], list(k["shape"])) for k in manifest["keys"]]
    n_values = sum(v.numel() for v in model.state_dict().values())
    same = ours == theirs and len(ours) == manifest["num_tensors"] and n_values == manifest["num_elements"]
    note = f"{len(ours)} tensors, {n_values} values"
    if not same:
        diff = sorted(set(map(str, ours)) ^ set(map(str, theirs)))
        note += f"; differences: {diff[:4]}"
    results.append(check(SUITE, "real/manifest keys+shapes (ordered)", same, note))
    state_dict = {k["name"]: torch.zeros(k["shape"]) for k in manifest["keys"]}
    try:
        load_hift_state_dict(HiFTGenerator(cfg), state_dict, "manifest-shaped state dict")
        results.append(check(SUITE, "real/strict load of manifest shapes", True))
    except ModelLoadError as exc:
        results.append(check(SUITE, "real/strict load of manifest shapes", False, str(exc)))
    return results
