"""Step-Audio2's token2wav (Step-Audio-2-mini flow with a DiT estimator, and HiFT): config, model
invariants, one stream and offline requests, chunk schedules, and the parity suite when the shared
fixtures are present."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cosyserve.bundle.step_audio2 import tiny_step_audio2_config
from cosyserve.config import dump_hyperpyyaml, load_hyperpyyaml
from cosyserve.config import Tagged
from cosyserve.errors import InvalidInputError, ModelLoadError
from cosyserve.models.step_audio2.cfm import EstimatorCache
from cosyserve.models.step_audio2.config import StepAudio2FlowConfig
from cosyserve.models.step_audio2.flow import StepAudio2Flow, load_step_audio2_flow
from cosyserve.models.hift import HiftConfig, HiFTGenerator
from cosyserve.schedule import StepAudio2ChunkScheduler, TokenChunk, plan_stream_chunks
from cosyserve.token2wav.step_audio2 import (OfflineRequest, StepAudio2Models, StepAudio2Stream, VoicePrompt,
                                             build_voice_state, offline_waveforms)

torch.set_num_threads(1)

PARITY_DIR = Path(os.environ.get("COSYSERVE_PARITY_DIR", Path(__file__).resolve().parents[2] / "shared" / "parity")) / "dit"
HOP = 480


TINY = tiny_step_audio2_config()
EMBED = TINY.encoder.input_size  # width of the speech-token embeddings the encoder takes


@pytest.fixture(scope="module")
def flow() -> StepAudio2Flow:
    torch.manual_seed(0)
    return StepAudio2Flow(TINY).eval()


@pytest.fixture(scope="module")
def hift() -> HiFTGenerator:
    torch.manual_seed(1)
    return HiFTGenerator(HiftConfig.tiny()).eval()


def zero_sine_noise(samples: int) -> torch.Tensor:
    return torch.zeros(1, samples, 9)


@pytest.fixture(scope="module")
def models(flow, hift) -> StepAudio2Models:
    return StepAudio2Models(flow, hift)


def open_stream(models: StepAudio2Models, voice: VoicePrompt) -> StepAudio2Stream:
    return StepAudio2Stream(models, build_voice_state(models.flow, voice), sine_noise=zero_sine_noise)


def prompt(seed: int, tokens: int = 20, frames: int = 41) -> VoicePrompt:
    g = torch.Generator().manual_seed(seed)
    return VoicePrompt(torch.randint(0, 6561, (tokens,), generator=g), torch.randn(frames, 80, generator=g),
                         torch.randn(192, generator=g))


def random_tokens(n: int, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------- config
def test_real_config_yaml_round_trip(tmp_path):
    path = tmp_path / "flow.yaml"
    dump_hyperpyyaml({"flow": StepAudio2FlowConfig.real().to_yaml_node()}, path)
    text = path.read_text()
    for tag in ("CausalMaskedDiffWithXvec", "upsample_encoder_v2.UpsampleConformerEncoderV2",
                "flow_matching.CausalConditionalCFM", "decoder_dit.DiT"):
        assert tag in text
    assert StepAudio2FlowConfig.from_yaml_tree(load_hyperpyyaml(path)) == StepAudio2FlowConfig.real()


def _with_encoder_option(key: str, value) -> Tagged:
    node = StepAudio2FlowConfig.real().to_yaml_node()
    node.kwargs["encoder"].kwargs[key] = value
    return node


@pytest.mark.parametrize("key,value", [("input_layer", "conv2d"), ("pos_enc_layer_type", "abs_pos"),
                                       ("up_stride", 4), ("use_cnn_module", True), ("brand_new_option", 1)])
def test_config_rejects_unsupported_encoder_options(key, value):
    with pytest.raises(ModelLoadError):
        StepAudio2FlowConfig.from_yaml_tree({"flow": _with_encoder_option(key, value)})


def test_config_rejects_inconsistent_sizes():
    node = StepAudio2FlowConfig.real().to_yaml_node()
    node.kwargs["decoder"].kwargs["estimator"].kwargs["in_channels"] = 240
    with pytest.raises(ModelLoadError, match="in_channels"):
        StepAudio2FlowConfig.from_yaml_tree(node)


def test_load_dit_flow_is_strict(tmp_path, flow):
    dump_hyperpyyaml({"flow": flow.cfg.to_yaml_node()}, tmp_path / "flow.yaml")
    state = flow.state_dict()
    torch.save(state, tmp_path / "flow.pt")
    loaded = load_step_audio2_flow(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    torch.save({k: v for k, v in state.items() if k != "encoder_proj.bias"}, tmp_path / "flow.pt")
    with pytest.raises(ModelLoadError, match="encoder_proj.bias"):
        load_step_audio2_flow(tmp_path)
    torch.save({**state, "decoder.extra": torch.zeros(1)}, tmp_path / "flow.pt")
    with pytest.raises(ModelLoadError, match="decoder.extra"):
        load_step_audio2_flow(tmp_path)


# ---------------------------------------------------------------------------------- estimator
def _estimator_inputs(batch: int, frames: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 80, frames, generator=g), torch.randn(batch, 80, frames, generator=g),
            torch.rand(batch, generator=g), torch.randn(batch, 80, generator=g), torch.randn(batch, 80, frames, generator=g)]


@torch.inference_mode()
def test_estimator_chunk_without_cache_equals_full(flow):
    est = flow.decoder.estimator
    x, mu, t, spks, cond = _estimator_inputs(2, 12)
    full = est(x, torch.ones(2, 1, 12), mu, t, spks, cond)
    chunk, _, att = est.forward_chunk(x, mu, t, spks, cond, *est.empty_caches(2, x.device, x.dtype))
    torch.testing.assert_close(chunk, full, atol=1e-5, rtol=0)
    est_cfg = TINY.estimator
    assert att.shape == (est_cfg.depth, 2, est_cfg.num_heads, 12, 2 * est_cfg.head_dim)


@torch.inference_mode()
def test_estimator_chunk_puts_new_frames_first_and_ignores_cache_order(flow):
    est = flow.decoder.estimator
    x, mu, t, spks, cond = _estimator_inputs(1, 10, seed=1)
    cnn, att = est.forward_chunk(*_estimator_inputs(1, 7, seed=2), *est.empty_caches(1, x.device, x.dtype))[1:]
    out, _, new_att = est.forward_chunk(x, mu, t, spks, cond, cnn, att)
    assert torch.equal(new_att[:, :, :, 10:], att)
    # No positional information: the cached frames' order does not change the result.
    shuffled = att[:, :, :, torch.randperm(7, generator=torch.Generator().manual_seed(3))]
    out_shuffled = est.forward_chunk(x, mu, t, spks, cond, cnn, shuffled)[0]
    torch.testing.assert_close(out_shuffled, out, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_estimator_padding_does_not_reach_valid_frames(flow):
    est = flow.decoder.estimator
    x, mu, t, spks, cond = _estimator_inputs(1, 9, seed=4)
    alone = est(x, torch.ones(1, 1, 9), mu, t, spks, cond)
    pad = lambda v: torch.cat([v, torch.randn(1, 80, 5)], dim=2)  # noqa: E731
    mask = torch.cat([torch.ones(1, 1, 9), torch.zeros(1, 1, 5)], dim=2)
    padded = est(pad(x), mask, pad(mu), t, spks, pad(cond))
    torch.testing.assert_close(padded[:, :, :9], alone, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------- encoder
@torch.inference_mode()
def test_encoder_batch_is_per_item(flow):
    g = torch.Generator().manual_seed(6)
    emb = torch.randn(2, 11, EMBED, generator=g)
    lens = torch.tensor([11, 6])
    out, mask = flow.encoder(emb, lens)
    alone, _ = flow.encoder(emb[1:, :6], lens[1:])
    assert mask[:, 0].sum(-1).tolist() == [22, 12]
    torch.testing.assert_close(out[1:, :12], alone, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_encoder_single_last_chunk_equals_full_sequence(flow):
    emb = torch.randn(1, 9, EMBED, generator=torch.Generator().manual_seed(7))
    full, _ = flow.encoder(emb, torch.tensor([9]))
    chunk, cache = flow.encoder.forward_chunk(emb, True, flow.encoder.empty_cache(emb.device, emb.dtype))
    torch.testing.assert_close(chunk, full, atol=1e-5, rtol=0)
    assert cache.frames == 18 and cache.token_att.shape[3] == 9


@torch.inference_mode()
def test_encoder_rejects_short_or_overlong_chunks(flow):
    enc = flow.encoder
    cache = enc.empty_cache(torch.device("cpu"), torch.float32)
    with pytest.raises(InvalidInputError, match="look-ahead"):
        enc.forward_chunk(torch.zeros(1, 3, EMBED), False, cache)
    long_frames = lambda att, frames: att.new_zeros(*att.shape[:3], frames, att.shape[4])  # noqa: E731
    long_cache = type(cache)(cache.lookahead, cache.upsample, long_frames(cache.token_att, 2499),
                             long_frames(cache.frame_att, 4998))
    with pytest.raises(InvalidInputError, match="too long"):
        enc.forward_chunk(torch.zeros(1, 5, EMBED), False, long_cache)


# ---------------------------------------------------------------------------------- trimming
def _labelled_cache(labels: list[str]) -> EstimatorCache:
    att = torch.arange(len(labels), dtype=torch.float32).view(1, 1, 1, 1, -1, 1)
    return EstimatorCache(torch.zeros(1), att)


def _trim_history(prompt_frames: int, chunk_frames: list[int]) -> list[str]:
    """Apply the runtime's concat-new-first + trim rule to labels; return the final labels."""
    labels = [f"P{i}" for i in range(prompt_frames)]
    for c, frames in enumerate(chunk_frames):
        labels = [f"c{c}.{i}" for i in range(frames)] + labels
        kept = _labelled_cache(labels).trimmed(prompt_frames, 100).att.flatten().long().tolist()
        labels = [labels[i] for i in kept]
    return labels


def test_trimming_keeps_newest_chunks_and_oldest_prompt_tail():
    # README §6.4, stream_equal chunk 4: c4, c3, c2, c1, c0[0:4], P[24:124]
    labels = _trim_history(124, [30] * 5)
    expected = ([f"c{c}.{i}" for c in (4, 3, 2, 1) for i in range(30)] + [f"c0.{i}" for i in range(4)]
                + [f"P{i}" for i in range(24, 124)])
    assert labels == expected
    # stream_exp chunk 3: a 200-frame chunk keeps only its first P = 124 frames.
    labels = _trim_history(124, [30, 50, 100, 200])
    assert labels == [f"c3.{i}" for i in range(124)] + [f"P{i}" for i in range(24, 124)]


# ---------------------------------------------------------------------------------- schedule
def test_chunk_plans_match_the_reference_tables():
    def ranges(n, strategy):
        return [(c.start, c.end, c.last) for c in plan_stream_chunks(n, strategy)]

    assert ranges(220, "exponential") == [(0, 18, False), (15, 43, False), (40, 93, False), (90, 193, False),
                                          (190, 220, True)]
    assert ranges(100, "equal") == [(s, s + 18, False) for s in range(0, 90, 15)] + [(90, 100, True)]
    assert ranges(18, "exponential") == [(0, 18, False), (15, 18, True)]
    assert ranges(10, "equal") == [(0, 10, True)]
    with pytest.raises(InvalidInputError, match="strategy"):
        plan_stream_chunks(10, "time_based")


def test_incremental_scheduler_agrees_with_plan():
    scheduler, sent = StepAudio2ChunkScheduler("exponential"), []
    for available in range(1, 301, 7):
        sent += scheduler.ready(available)
    sent.append(scheduler.finish(300))
    assert sent == plan_stream_chunks(300, "exponential")
    assert sent[-1] == TokenChunk(190, 300, True)


# ---------------------------------------------------------------------------------- one stream
def test_stream_sample_counts_and_release(models):
    stream = open_stream(models, prompt(0))
    tokens, frames, samples = random_tokens(60), 0, []
    for chunk in plan_stream_chunks(60, "exponential"):
        result = stream.step_chunk(tokens[chunk.start:chunk.end], chunk.last)
        frames += result.mel.shape[2]
        samples.append(result.audio.shape[1])
        assert torch.isfinite(result.audio).all()
    assert samples[0] == HOP * (30 - 8) and sum(samples) == HOP * frames == HOP * 2 * 60
    assert stream.closed and stream.cache is None
    with pytest.raises(InvalidInputError, match="closed"):
        stream.step(tokens[:5], True)


def test_stream_shares_the_voice_state_without_modifying_it(models):
    state = build_voice_state(models.flow, prompt(0))
    before = state.flow_cache.estimator.att.clone()
    assert state.prompt_frames == 40  # n = min(41 // 2, 20) tokens, 2 frames each
    with StepAudio2Stream(models, state, sine_noise=zero_sine_noise) as stream:
        stream.step(random_tokens(18), False)
        assert stream.cache.estimator.frames == 40 + 30
    assert stream.closed  # context exit = cancel
    assert torch.equal(state.flow_cache.estimator.att, before)


def test_stream_errors_release_state(models):
    stream = open_stream(models, prompt(0))
    with pytest.raises(InvalidInputError, match="look-ahead"):
        stream.step(random_tokens(3), False)  # a non-last chunk needs more than 3 tokens
    assert stream.closed and stream.cache is None
    stream = open_stream(models, prompt(0))
    with pytest.raises(InvalidInputError, match="0..6560"):
        stream.step([1, 2, 6561, 4, 5], True)
    assert stream.closed
    stream.close()  # idempotent


def test_a_voice_prompt_shorter_than_the_look_ahead_is_refused(models):
    with pytest.raises(InvalidInputError, match="too short"):
        build_voice_state(models.flow, prompt(1, tokens=2, frames=40))


def test_empty_final_chunk_flushes_the_withheld_tail(models):
    stream = open_stream(models, prompt(0))
    first = stream.step(random_tokens(18), False)
    tail = stream.step([], True)
    assert first.numel() + tail.numel() == HOP * 30 and tail.numel() == HOP * 8


def test_offline_batch_equals_single_requests(models):
    requests = [OfflineRequest(random_tokens(25, seed=8), prompt(0)),
                OfflineRequest(random_tokens(9, seed=9), prompt(1, tokens=12, frames=25))]
    batched = offline_waveforms(models, requests, sine_noise=zero_sine_noise)
    assert [w.numel() for w in batched] == [HOP * (2 * 45 - 41), HOP * (2 * 21 - 25)]
    for request, wave in zip(requests, batched):
        (alone,) = offline_waveforms(models, [request], sine_noise=zero_sine_noise)
        torch.testing.assert_close(wave, alone, atol=1e-5, rtol=0)  # upstream-style leak: ~3e-4


# ---------------------------------------------------------------------------------- parity
@pytest.mark.skipif(not (PARITY_DIR / "manifest.json").is_file(), reason=f"no Step-Audio2 parity fixtures at {PARITY_DIR}")
def test_parity_suite():
    from cosyserve.parity import step_audio2

    assert step_audio2.detect(PARITY_DIR)
    results = step_audio2.run(PARITY_DIR)
    failed = [f"{r.case}: max-abs {r.max_abs:.3g} ({r.tolerance}) {r.note}" for r in results if not r.passed]
    assert len(results) > 150 and not failed, "\n".join(failed)
