"""Parity suite "cv2_flow": the CosyVoice2 flow against the reference fixtures (README sections 4 and 8).

Files: ``flow_tiny.pt`` + ``flow_tiny_config.json`` (tiny model), ``flow_tiny_io.safetensors``
(inputs, intermediates, outputs), ``fixture_meta.json`` (the chunk schedule) and optionally
``flow_real_manifest.json`` (real-size state-dict keys).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import ModelLoadError
from ..models.flow import CosyVoice2Flow, FlowConfig, fixed_noise, flow_from_state_dict, load_flow_state_dict
from ..models.flow.config import NUM_UP_BLOCKS, check_fixed_encoder_parts
from . import CaseResult, check, compare, is_cosyvoice3_fixture

SUITE = "cv2_flow"
# README section 2: fp32 reference vs fp64 lands at ~2.5e-6.
FLOW_REL_L2 = 1e-4


def detect(fixture_dir: Path) -> bool:
    return not is_cosyvoice3_fixture(fixture_dir) and (fixture_dir / "flow_tiny.pt").is_file() and \
        (fixture_dir / "flow_tiny_io.safetensors").is_file()


def run(fixture_dir: Path) -> list[CaseResult]:
    results: list[CaseResult] = []
    manifest_path = fixture_dir / "flow_real_manifest.json"
    if manifest_path.is_file():
        results.append(_real_manifest_case(json.loads(manifest_path.read_text())))
    cfg = FlowConfig.from_fixture_json(json.loads((fixture_dir / "flow_tiny_config.json").read_text()))
    try:
        state_dict = torch.load(fixture_dir / "flow_tiny.pt", map_location="cpu", weights_only=True)
        model = flow_from_state_dict(cfg, state_dict, "flow_tiny.pt")
    except ModelLoadError as exc:
        return results + [check(SUITE, "flow_tiny_strict_load", False, str(exc)[:200])]
    results.append(check(SUITE, "flow_tiny_strict_load", True, f"{len(state_dict)} tensors"))
    io = load_file(fixture_dir / "flow_tiny_io.safetensors")
    with torch.inference_mode():
        results += _nonstream_cases(model, io)
        results += _stream_cases(model, io, _chunk_schedule(fixture_dir))
    return results


def _real_manifest_case(manifest: dict) -> CaseResult:
    """Real-size key/shape/dtype equality and a strict load of manifest-shaped tensors (meta device: no memory)."""
    case = "flow_real_manifest_strict_load"
    try:
        cfg = _manifest_config(manifest)
        with torch.device("meta"):
            model = CosyVoice2Flow(cfg)
        ours = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()}
        theirs = {t["name"]: (tuple(t["shape"]), t["dtype"]) for t in manifest["keys"]}
        differing = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        if differing:
            return check(SUITE, case, False, f"{len(differing)} keys differ, e.g. {differing[:3]}")
        state_dict = {name: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
                      for name, (shape, dtype) in theirs.items()}
        load_flow_state_dict(model, state_dict, "flow_real_manifest.json")
    except (ModelLoadError, KeyError) as exc:
        return check(SUITE, case, False, str(exc)[:200])
    numel = sum(v.numel() for v in model.state_dict().values())
    same = "= FlowConfig.real()" if cfg == FlowConfig.real() else "!= FlowConfig.real()"
    return check(SUITE, case, True, f"{len(theirs)} tensors, {numel} values, config {same}")


def _manifest_config(manifest: dict) -> FlowConfig:
    sections = manifest.get("config")
    if not sections:
        return FlowConfig.real()
    cfg = FlowConfig.from_sections(sections["flow"], sections["encoder"], sections["cfm"], sections["estimator"])
    check_fixed_encoder_parts(cfg, sections.get("encoder_pre_lookahead_layer", {}),
                              sections.get("encoder_up_layer", {}), NUM_UP_BLOCKS)
    return cfg


def _inputs(io: dict[str, torch.Tensor], num_tokens: int | None = None) -> tuple[torch.Tensor, ...]:
    token = io["token"] if num_tokens is None else io["token"][:, :num_tokens]
    return token, io["prompt_token"], io["prompt_feat"], io["embedding"]


def _nonstream_cases(model: CosyVoice2Flow, io: dict[str, torch.Tensor]) -> list[CaseResult]:
    c = model.conditions(*_inputs(io), streaming=False, finalize=True)
    cfm = model.decoder
    z = fixed_noise(c.mu.size(2))
    steps = list(cfm.euler_steps(z, c.mask, c.mu, c.spks, c.cond, streaming=False))
    t_span = cfm.time_span(len(steps), c.mu.device, c.mu.dtype)
    estimator_step0 = cfm.estimator(*cfm.guidance_batch(z, c.mask, c.mu, t_span[0], c.spks, c.cond), streaming=False)
    mel = model.inference(*_inputs(io), streaming=False, finalize=True)
    return [
        compare(SUITE, "nonstream/spk_proj", c.spks, io["nonstream/spk_proj"], rel_l2=1e-5),
        compare(SUITE, "nonstream/encoder_out", c.encoder_out, io["nonstream/encoder_out"], rel_l2=FLOW_REL_L2),
        compare(SUITE, "nonstream/mu", c.mu, io["nonstream/mu"], rel_l2=FLOW_REL_L2),
        compare(SUITE, "nonstream/cond", c.cond, io["nonstream/cond"], max_abs=1e-6),
        compare(SUITE, "nonstream/z (fixed noise)", z, io["rand_noise_used"]),
        compare(SUITE, "nonstream/t_span", t_span, io["nonstream/t_span"], max_abs=1e-6),
        compare(SUITE, "nonstream/estimator_t", torch.stack([t for t, _ in steps]), io["nonstream/estimator_t"],
                max_abs=1e-6),
        compare(SUITE, "nonstream/estimator_out_step0", estimator_step0, io["nonstream/estimator_out_step0"],
                rel_l2=FLOW_REL_L2),
        compare(SUITE, "nonstream/x_steps", torch.cat([x for _, x in steps]), io["nonstream/x_steps"],
                rel_l2=FLOW_REL_L2),
        compare(SUITE, "nonstream/mel", mel, io["nonstream/mel"], rel_l2=FLOW_REL_L2),
    ]


def _chunk_schedule(fixture_dir: Path) -> list[dict]:
    meta_path = fixture_dir / "fixture_meta.json"
    if not meta_path.is_file():
        return []
    return json.loads(meta_path.read_text()).get("flow_io", {}).get("chunks", [])


def _stream_cases(model: CosyVoice2Flow, io: dict[str, torch.Tensor], chunks: list[dict]) -> list[CaseResult]:
    runs = [("stream_full", None, True, True)]
    runs += [(f"chunk{i}", c["num_tokens"], c["streaming"], c["finalize"]) for i, c in enumerate(chunks)]
    results = []
    for prefix, num_tokens, streaming, finalize in runs:
        if f"{prefix}/mel" not in io:
            continue
        inputs = _inputs(io, num_tokens)
        mu = model.conditions(*inputs, streaming=streaming, finalize=finalize).mu
        mel = model.inference(*inputs, streaming=streaming, finalize=finalize)
        note = f"tokens={inputs[0].size(1)} streaming={streaming} finalize={finalize}"
        results.append(compare(SUITE, f"{prefix}/mu", mu, io[f"{prefix}/mu"], rel_l2=FLOW_REL_L2, note=note))
        results.append(compare(SUITE, f"{prefix}/mel", mel, io[f"{prefix}/mel"], rel_l2=FLOW_REL_L2, note=note))
    if not chunks and "chunk0/mel" in io:
        results.append(check(SUITE, "chunk schedule", False,
                             "chunk*/mel stored but fixture_meta.json has no flow_io.chunks"))
    return results
