"""Parity suite "cv3_flow": the CosyVoice3 flow (DiT) against ``flow_tiny_io.safetensors``.

Order follows the fixture README §4: the conditions (speaker vector, token embedding,
pre-look-ahead output, mu, cond), the fixed noise and time grid, the estimator's first call
with its intermediates, every Euler state, then the mels of every recorded call — offline,
block-masked on the whole sequence, the Triton chunk calls (block masks, look-ahead context) and
their full-attention variants (what a TensorRT estimator computes, README §6.5). Tolerance:
rel-L2 < 1e-5 for every flow tensor (README §2).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..config import load_hyperpyyaml
from ..errors import ModelLoadError
from ..models.cosyvoice3.config import Cv3FlowConfig
from ..models.cosyvoice3.dit import rotary
from ..models.cosyvoice3.flow import CosyVoice3Flow, load_cosyvoice3_flow
from ..models.flow.cfm import cosine_time_grid, fixed_noise
from . import CaseResult, check, compare, is_cosyvoice3_fixture, manifest_case

SUITE = "cv3_flow"
CHECKPOINT, IO_FILE, CONFIG_FILE, YAML_FILE = ("flow_tiny.pt", "flow_tiny_io.safetensors", "flow_tiny_config.json",
                                               "cosyvoice3_tiny.yaml")
MANIFEST_FILE, META_FILE = "flow_real_manifest.json", "fixture_meta.json"
FLOW_REL_L2 = 1e-5


def detect(fixture_dir: Path) -> bool:
    return is_cosyvoice3_fixture(fixture_dir) and (fixture_dir / CHECKPOINT).is_file() and \
        (fixture_dir / IO_FILE).is_file()


def run(fixture_dir: Path) -> list[CaseResult]:
    cfg = Cv3FlowConfig.from_fixture_json(json.loads((fixture_dir / CONFIG_FILE).read_text()))
    results = []
    if (fixture_dir / YAML_FILE).is_file():
        same = Cv3FlowConfig.from_yaml_tree(load_hyperpyyaml(fixture_dir / YAML_FILE)) == cfg
        results.append(check(SUITE, "config/yaml == json", same, f"{YAML_FILE} vs {CONFIG_FILE}"))
    try:
        model = load_cosyvoice3_flow(fixture_dir, config=cfg, weights=fixture_dir / CHECKPOINT)
        results.append(check(SUITE, "load/strict", True, f"{len(model.state_dict())} tensors"))
    except ModelLoadError as exc:
        return results + [check(SUITE, "load/strict", False, str(exc)[:200])]
    io = load_file(str(fixture_dir / IO_FILE))
    with torch.inference_mode():
        results += _nonstream_cases(model, io)
        results += _call_cases(model, io, _schedule(fixture_dir))
    if (fixture_dir / MANIFEST_FILE).is_file():
        manifest = json.loads((fixture_dir / MANIFEST_FILE).read_text())
        results.append(manifest_case(SUITE, Cv3FlowConfig, CosyVoice3Flow, manifest))
    return results


def _inputs(io: dict, num_tokens: int | None = None) -> tuple[torch.Tensor, ...]:
    token = io["token"] if num_tokens is None else io["token"][:, :num_tokens]
    return token, io["prompt_token"], io["prompt_feat"], io["embedding"]


def _nonstream_cases(model: CosyVoice3Flow, io: dict) -> list[CaseResult]:
    c = model.prepare(*_inputs(io), finalize=True)
    z = fixed_noise(c.mu.shape[2])
    steps = list(model.decoder.euler_steps(z, c.mask, c.mu, c.spks, c.cond, streaming=False))
    results = [
        compare(SUITE, "nonstream/spk_proj", c.spks, io["nonstream/spk_proj"], rel_l2=FLOW_REL_L2),
        compare(SUITE, "nonstream/token_emb", c.token_emb, io["nonstream/token_emb"], rel_l2=FLOW_REL_L2),
        compare(SUITE, "nonstream/pre_lookahead_out", c.pre_lookahead_out, io["nonstream/pre_lookahead_out"],
                rel_l2=FLOW_REL_L2),
        compare(SUITE, "nonstream/mu", c.mu, io["nonstream/mu"], rel_l2=FLOW_REL_L2),
        compare(SUITE, "nonstream/cond", c.cond, io["nonstream/cond"], max_abs=1e-6),
        compare(SUITE, "nonstream/z (fixed noise)", z, io["rand_noise_used"]),
        compare(SUITE, "nonstream/t_span", cosine_time_grid(len(steps), z.device, z.dtype), io["nonstream/t_span"],
                max_abs=1e-6),
        compare(SUITE, "nonstream/estimator_t", torch.stack([t for t, _, _ in steps]), io["nonstream/estimator_t"],
                max_abs=1e-6),
    ]
    results += _estimator_step0_cases(model, io, z, c)
    results += [
        compare(SUITE, "nonstream/estimator_out_step0", steps[0][1], io["nonstream/estimator_out_step0"],
                rel_l2=FLOW_REL_L2),
        compare(SUITE, "nonstream/x_steps", torch.cat([x for _, _, x in steps]), io["nonstream/x_steps"],
                rel_l2=FLOW_REL_L2),
        compare(SUITE, "nonstream/mel", model.inference(*_inputs(io), streaming=False, finalize=True),
                io["nonstream/mel"], rel_l2=FLOW_REL_L2),
    ]
    return results


def _estimator_step0_cases(model: CosyVoice3Flow, io: dict, z: torch.Tensor, c) -> list[CaseResult]:
    """The DiT's intermediates in its first call (batch = conditional row + unconditional row)."""
    est = model.decoder.estimator
    prefix = "nonstream/dit_step0/"
    t = io["nonstream/estimator_t"][:1].expand(2)
    zeros = torch.zeros_like
    x, mu, spks, cond = torch.cat([z, z]), torch.cat([c.mu, zeros(c.mu)]), torch.cat([c.spks, zeros(c.spks)]), \
        torch.cat([c.cond, zeros(c.cond)])
    t_emb = est.time_embed(t)
    proj = est.input_embed.project(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)
    h = est.input_embed.conv_pos_embed(proj) + proj
    angles = est.rotary_embed.angles(h.shape[1])
    results = [
        compare(SUITE, prefix + "time_embed", t_emb, io[prefix + "time_embed"], rel_l2=FLOW_REL_L2),
        compare(SUITE, prefix + "input_proj", proj, io[prefix + "input_proj"], rel_l2=FLOW_REL_L2),
        compare(SUITE, prefix + "input_embed", h, io[prefix + "input_embed"], rel_l2=FLOW_REL_L2),
        compare(SUITE, prefix + "rope_freqs", angles, io[prefix + "rope_freqs"], rel_l2=FLOW_REL_L2),
    ]
    rotation = rotary(angles)
    for i, block in enumerate(est.transformer_blocks):
        h = block(h, t_emb, rotation, None)
        if prefix + f"block{i}" in io:
            results.append(compare(SUITE, prefix + f"block{i}", h, io[prefix + f"block{i}"], rel_l2=FLOW_REL_L2))
    results.append(compare(SUITE, prefix + "norm_out", est.norm_out(h, t_emb), io[prefix + "norm_out"],
                           rel_l2=FLOW_REL_L2))
    return results


def _schedule(fixture_dir: Path) -> list[dict]:
    meta_path = fixture_dir / META_FILE
    return json.loads(meta_path.read_text()).get("triton_schedule", []) if meta_path.is_file() else []


def _call_cases(model: CosyVoice3Flow, io: dict, schedule: list[dict]) -> list[CaseResult]:
    """Every recorded flow call: (prefix, tokens, streaming, finalize), with mu where stored."""
    runs = [("stream_full", None, True, True)]
    runs += [(f"chunk{i}", c["num_tokens"], c["streaming"], c["finalize"]) for i, c in enumerate(schedule)]
    runs += [(f"chunk{i}", c["num_tokens"], False, c["finalize"]) for i, c in enumerate(schedule)
             if f"chunk{i}/mel_fullattn" in io]
    results = []
    for prefix, num_tokens, streaming, finalize in runs:
        inputs = _inputs(io, num_tokens)
        key = f"{prefix}/mel" if streaming or finalize else f"{prefix}/mel_fullattn"
        note = f"tokens={inputs[0].shape[1]} streaming={streaming} finalize={finalize}"
        if key == f"{prefix}/mel" and f"{prefix}/mu" in io:
            mu = model.prepare(*inputs, finalize=finalize).mu
            results.append(compare(SUITE, f"{prefix}/mu", mu, io[f"{prefix}/mu"], rel_l2=FLOW_REL_L2, note=note))
        mel = model.inference(*inputs, streaming=streaming, finalize=finalize)
        results.append(compare(SUITE, key, mel, io[key], rel_l2=FLOW_REL_L2, note=note))
    if not schedule and "chunk0/mel" in io:
        results.append(check(SUITE, "chunk schedule", False, "chunk*/mel stored but fixture_meta.json has no "
                                                             "triton_schedule"))
    return results
