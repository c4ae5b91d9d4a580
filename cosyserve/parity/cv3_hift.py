"""Parity suite "cv3_hift": the CosyVoice3 causal HiFT against ``hift_tiny_io.safetensors``.

Order follows the fixture README §5.1: the fixed noise buffers (our replay of upstream's
construction draws), F0 from the mel (float64 predictor), the excitation from F0 with the fixed
noise and with zero noise, decode-only from the stored excitation (tight), conv_post, end to
end, the prefix property of non-final calls, then loading checks incl. the real-size manifest and
the real-size noise hashes. Tolerances: README §2.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import ModelLoadError
from ..models.cosyvoice3.config import CausalHiftConfig
from ..models.cosyvoice3.hift import CausalHiFTGenerator, SourceNoiseBuffer, load_causal_hift
from . import CaseResult, check, compare, is_cosyvoice3_fixture, manifest_case

SUITE = "cv3_hift"
CHECKPOINT, IO_FILE, CONFIG_FILE = "hift_tiny.pt", "hift_tiny_io.safetensors", "hift_tiny_config.json"
MANIFEST_FILE, META_FILE = "hift_real_manifest.json", "fixture_meta.json"

F0_REL_L2 = 1e-6
TIGHT = 1e-5  # decode-only, conv_post
SINE = 1e-2  # anything downstream of the float32 sine phase
# (case, finalize) as recorded (README §5.1); a_nf's excitation is the prefix of a's.
CASES = (("a", True), ("a_nf", False), ("b", False))


def detect(fixture_dir: Path) -> bool:
    return is_cosyvoice3_fixture(fixture_dir) and (fixture_dir / CHECKPOINT).is_file() and \
        (fixture_dir / IO_FILE).is_file()


def run(fixture_dir: Path) -> list[CaseResult]:
    cfg = CausalHiftConfig.from_fixture_json(json.loads((fixture_dir / CONFIG_FILE).read_text()))
    try:
        model = load_causal_hift(fixture_dir, config=cfg, weights=fixture_dir / CHECKPOINT, fold_weight_norm=False)
        results = [check(SUITE, "load/strict", True, f"{len(model.state_dict())} tensors")]
    except ModelLoadError as exc:
        return [check(SUITE, "load/strict", False, str(exc)[:200])]
    io = load_file(str(fixture_dir / IO_FILE))
    with torch.inference_mode():
        noise = io["noise/sine_waves"]
        results += [
            compare(SUITE, "noise/rand_ini (replayed draws)", model.noise.rand_ini, io["noise/rand_ini"]),
            compare(SUITE, "noise/sine_waves (replayed draws)", model.noise.rows(0, noise.shape[1]), noise),
        ]
        for case, finalize in CASES:
            results += _case(model, io, case, finalize)
        spectrum = model.predict_spectrum(io["a/mel"], io["a/source"], True)
        results.append(compare(SUITE, "a/conv_post_out", spectrum, io["a/conv_post_out"], rel_l2=TIGHT))
        prefix = model.inference(io["b/mel"], False)[0][:, :io["a_nf/speech"].shape[1]]
        results.append(compare(SUITE, "b prefix = a_nf (non-final output is final)", prefix,
                               model.inference(io["a/mel"], False)[0], max_abs=1e-5))
        folded = load_causal_hift(fixture_dir, config=cfg, weights=fixture_dir / CHECKPOINT)
        results.append(compare(SUITE, "folded weight norm/a/decode", folded.decode(io["a/mel"], io["a/source"], True),
                               model.decode(io["a/mel"], io["a/source"], True), max_abs=1e-6,
                               note="vs. parametrized model"))
    if (fixture_dir / MANIFEST_FILE).is_file():
        manifest = json.loads((fixture_dir / MANIFEST_FILE).read_text())
        results.append(manifest_case(SUITE, CausalHiftConfig, CausalHiFTGenerator, manifest))
        results += _real_noise_cases(fixture_dir)
    return results


def _case(model: CausalHiFTGenerator, io: dict, case: str, finalize: bool) -> list[CaseResult]:
    mel, note = io[f"{case}/mel"], f"finalize={finalize}"
    f0 = model.predict_f0(mel, finalize)
    frames = f0.shape[1]
    stored_source = io.get(f"{case}/source", io["a/source"][:, :, :model.hop_length * frames])
    zero_source = io.get(f"{case}/source".replace("/", "_zero/"), io["a_zero/source"][:, :, :model.hop_length * frames])
    voicing_same = bool(((f0 > model.cfg.nsf_voiced_threshold) == (io[f"{case}/f0"] > model.cfg.nsf_voiced_threshold))
                        .all()) if f0.shape == io[f"{case}/f0"].shape else False
    source, _ = model.compute_source(f0)
    silent = torch.zeros(1, model.hop_length * frames, model.m_source.num_harmonics)
    source_zero, _ = model.m_source(f0, silent)
    results = [
        compare(SUITE, f"{case}/f0", f0, io[f"{case}/f0"], rel_l2=F0_REL_L2, note=note),
        check(SUITE, f"{case}/voiced decisions", voicing_same),
        compare(SUITE, f"{case}/source (from f0)", source, stored_source, rel_l2=SINE),
        compare(SUITE, f"{case}_zero/source (from f0, zero noise)", source_zero, zero_source, rel_l2=SINE),
        compare(SUITE, f"{case}/decode speech (stored source)", model.decode(mel[:, :, :frames], stored_source,
                                                                              finalize),
                io[f"{case}/speech"], rel_l2=TIGHT, note=note),
        compare(SUITE, f"{case}_zero/decode speech (stored source)",
                model.decode(mel[:, :, :frames], zero_source, finalize), io[f"{case}_zero/speech"], rel_l2=TIGHT),
        compare(SUITE, f"{case}/speech (end to end)", model.inference(mel, finalize)[0], io[f"{case}/speech"],
                rel_l2=SINE, note=note),
    ]
    return results



def _real_noise_cases(fixture_dir: Path) -> list[CaseResult]:
    """Our replay of upstream's construction draws at the real size against the recorded values."""
    meta_path = fixture_dir / META_FILE
    recorded = json.loads(meta_path.read_text()).get("hift_fixed_noise_real_size") if meta_path.is_file() else None
    if not recorded:
        return []
    real = CausalHiftConfig.real()
    buffer = SourceNoiseBuffer(real.nb_harmonics + 1, real.f0_in_channels, real.f0_cond_channels)
    rows = buffer.rows(0, int(recorded["samples_stored_or_hashed"]))
    digest = hashlib.sha256(rows.contiguous().numpy().tobytes()).hexdigest()
    return [
        compare(SUITE, "real size noise/rand_ini", buffer.rand_ini, torch.tensor([recorded["rand_ini"]])),
        compare(SUITE, "real size noise/sine_waves rows 0-1", rows[0, :2],
                torch.tensor([recorded["sine_waves_first_row"], recorded["sine_waves_row_1"]])),
        check(SUITE, f"real size noise/sine_waves sha256 of {rows.shape[1]} rows",
              digest == recorded["sha256_sine_waves_prefix_float32"], digest[:16]),
    ]
