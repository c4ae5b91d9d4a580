"""CosyVoice2 flow: parity with the reference fixtures, config round trips, loading and input errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosyserve.config import dump_hyperpyyaml, load_hyperpyyaml
from cosyserve.errors import InvalidInputError, ModelLoadError
from cosyserve.models.flow import (
    CosyVoice2Flow,
    EncoderConfig,
    EstimatorConfig,
    FlowConfig,
    fixed_noise,
    load_flow,
    random_flow_state_dict,
)
from cosyserve.parity import cv2_flow

torch.set_num_threads(1)

# A small flow with the real structure, for tests that must not depend on the fixtures.
SMALL = FlowConfig(
    input_size=32,
    encoder=EncoderConfig(input_size=32, output_size=32, attention_heads=2, linear_units=64, num_blocks=1),
    estimator=EstimatorConfig(channels=(32,), attention_head_dim=8, num_heads=2, n_blocks=1, num_mid_blocks=1),
)

# Shaped like the released cosyvoice2.yaml: refs, arithmetic refs, "1e-06" (a string to PyYAML)
# and the legacy estimator spelling.
RELEASED_STYLE_YAML = """\
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: -1
spk_embed_dim: 192
flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: 512
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: 512
        attention_heads: 8
        linear_units: 2048
        num_blocks: 6
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: 512
        static_chunk_size: !ref <chunk_size>
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                inference_cfg_rate: 0.7
        estimator: !new:cosyvoice.flow.decoder.ConditionalDecoder
            in_channels: 320
            out_channels: 80
            causal: {causal}
            channels: [256]
            attention_head_dim: 64
            n_blocks: 4
            num_mid_blocks: 12
            num_heads: 8
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>
"""


@pytest.fixture(scope="module")
def small_flow() -> CosyVoice2Flow:
    model = CosyVoice2Flow(SMALL)
    model.load_state_dict(random_flow_state_dict(SMALL, seed=3))
    return model.eval()


def _request(prompt_tokens: int = 5, tokens: int = 12, batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 6561, (batch, tokens), generator=g),
        torch.randint(0, 6561, (batch, prompt_tokens), generator=g),
        torch.randn(batch, 2 * prompt_tokens, 80, generator=g),
        torch.randn(batch, 192, generator=g),
    )


def test_parity_suite_passes(parity_dir: Path):
    fixtures = parity_dir / "cosyvoice2"
    if not cv2_flow.detect(fixtures):
        pytest.skip(f"no flow fixtures in {fixtures}")
    results = cv2_flow.run(fixtures)
    failed = [f"{r.case}: rel-L2 {r.rel_l2:.2e} max-abs {r.max_abs:.2e} {r.note}" for r in results if not r.passed]
    assert not failed, failed
    expected = {"nonstream/mel", "chunk0/mel", "chunk2/mel", "flow_tiny_strict_load", "flow_real_manifest_strict_load"}
    assert expected <= {r.case for r in results}


@pytest.mark.parametrize("cfg", [FlowConfig.real(), SMALL], ids=["real", "small"])
def test_yaml_round_trip(tmp_path: Path, cfg: FlowConfig):
    path = tmp_path / "cosyvoice2.yaml"
    dump_hyperpyyaml({"flow": cfg.to_yaml_node()}, path)
    assert "!new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec" in path.read_text()
    assert FlowConfig.from_yaml_tree(load_hyperpyyaml(path)) == cfg


def test_released_style_yaml_gives_real_config(tmp_path: Path):
    path = tmp_path / "cosyvoice2.yaml"
    path.write_text(RELEASED_STYLE_YAML.replace("{causal}", "True"))
    assert FlowConfig.from_yaml_tree(load_hyperpyyaml(path)) == FlowConfig.real()
    path.write_text(RELEASED_STYLE_YAML.replace("{causal}", "False"))
    with pytest.raises(ModelLoadError, match="non-causal"):
        FlowConfig.from_yaml_tree(load_hyperpyyaml(path))


def test_unsupported_config_is_rejected():
    with pytest.raises(ModelLoadError, match="channels"):
        FlowConfig(estimator=EstimatorConfig(channels=(256, 256)))
    with pytest.raises(ModelLoadError, match="input_size"):
        FlowConfig(input_size=256)


def test_load_flow_round_trip_and_strict_errors(tmp_path: Path, small_flow: CosyVoice2Flow):
    dump_hyperpyyaml({"flow": SMALL.to_yaml_node()}, tmp_path / "cosyvoice2.yaml")
    state_dict = small_flow.state_dict()
    torch.save(state_dict, tmp_path / "flow.pt")
    loaded = load_flow(tmp_path)
    request = _request()
    expected = small_flow.inference(*request, streaming=False, finalize=True)
    assert torch.equal(loaded.inference(*request, streaming=False, finalize=True), expected)

    broken = dict(state_dict)
    del broken["encoder_proj.bias"]
    broken["decoder.estimator.extra.weight"] = torch.zeros(1)
    broken["encoder.after_norm.weight"] = torch.zeros(7)
    torch.save(broken, tmp_path / "flow.pt")
    with pytest.raises(ModelLoadError) as info:
        load_flow(tmp_path)
    message = str(info.value)
    assert "missing keys (1): encoder_proj.bias" in message
    assert "unexpected keys (1): decoder.estimator.extra.weight" in message
    assert "encoder.after_norm.weight (7,)" in message

    (tmp_path / "flow.pt").unlink()
    with pytest.raises(ModelLoadError, match="not found"):
        load_flow(tmp_path)


def test_random_init_is_seeded_nontrivial_and_leaves_global_rng():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = random_flow_state_dict(SMALL, seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = random_flow_state_dict(SMALL, seed=7)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["decoder.estimator.final_proj.weight"].abs().sum() > 0
    assert a["encoder.encoders.0.self_attn.pos_bias_u"].abs().sum() > 0


def test_outputs_shapes_streaming_and_batch(small_flow: CosyVoice2Flow):
    token, prompt_token, prompt_feat, embedding = _request(prompt_tokens=5, tokens=12)
    offline = small_flow.inference(token, prompt_token, prompt_feat, embedding, streaming=False, finalize=True)
    assert offline.shape == (1, 80, 24) and offline.dtype == torch.float32 and offline.std() > 0.1
    partial = small_flow.inference(token, prompt_token, prompt_feat, embedding, streaming=True, finalize=False)
    assert partial.shape == (1, 80, 18)
    other_speaker = small_flow.inference(token, prompt_token, prompt_feat, -embedding, streaming=False, finalize=True)
    assert not torch.allclose(other_speaker, offline)
    pair = [torch.cat([v, v]) for v in (token, prompt_token, prompt_feat, embedding)]
    batched = small_flow.inference(*pair, streaming=False, finalize=True)
    torch.testing.assert_close(batched, offline.expand(2, -1, -1), rtol=1e-5, atol=1e-5)


def test_fixed_noise_is_the_seed0_buffer_and_keeps_global_rng():
    torch.manual_seed(99)
    expected_next = torch.rand(3)
    torch.manual_seed(99)
    noise = fixed_noise(4)
    assert torch.equal(torch.rand(3), expected_next)
    torch.testing.assert_close(noise[0, 0], torch.tensor([-1.1258398, -1.1523602, -0.2505786, -0.4338788]))
    assert fixed_noise(15000).shape == (1, 80, 15000)
    with pytest.raises(InvalidInputError, match="15000"):
        fixed_noise(15001)


@pytest.mark.parametrize(
    "change, finalize, match",
    [
        (lambda r: (r[0], r[1], r[2][:, :-1], r[3]), True, "prompt_feat"),
        (lambda r: (r[0][:, :0], r[1], r[2], r[3]), True, "empty"),
        (lambda r: (r[0][:, :3], r[1], r[2], r[3]), False, "more than 3 tokens"),
        (lambda r: (r[0].float(), r[1], r[2], r[3]), True, "integer"),
        (lambda r: (r[0] + 6561, r[1], r[2], r[3]), True, "0..6560"),
        (lambda r: (r[0], r[1], r[2], r[3][:, :100]), True, "192"),
        (lambda r: (r[0], r[1], r[2], torch.cat([r[3], r[3]])), True, "batch size"),
        (lambda r: (r[0][0], r[1], r[2], r[3]), True, "2-D"),
        (lambda r: (torch.zeros(1, 7496, dtype=torch.long), r[1], r[2], r[3]), True, "maximum 15000"),
    ],
    ids=["prompt-feat-length", "empty", "lookahead", "float-ids", "id-range", "embedding-dim", "batch",
         "token-ndim", "too-long"],
)
def test_bad_inputs(small_flow: CosyVoice2Flow, change, finalize: bool, match: str):
    with pytest.raises(InvalidInputError, match=match):
        small_flow.inference(*change(_request()), streaming=True, finalize=finalize)


def test_frame_buffers_extended_together_equal_each_extended_alone():
    """extend_all (one copy for a batch of streams' windows) gives each buffer what its own extend
    gives: a fresh one, a fork (copied into storage of its own), one with room, one that must grow."""
    from cosyserve.models.flow.cache import FrameBuffer

    def buffers() -> list:
        fresh, voice, roomy, full = (FrameBuffer(dim=2) for _ in range(4))
        voice.start_with(torch.arange(12.0).reshape(1, 2, 6), commit=4)
        roomy.extend(torch.ones(1, 2, 5), commit=2)
        roomy.extend(torch.ones(1, 2, 1), commit=1)  # 3 committed in storage of 5
        full.start_with(torch.arange(8.0).reshape(1, 2, 4), commit=4)
        return [fresh, voice.fork(), roomy, full]

    windows = [torch.randn(1, 2, n, generator=torch.Generator().manual_seed(n)) for n in (3, 2, 1, 4)]
    commits = [2, 2, 1, 3]
    alone = [b.extend(w, c) for b, w, c in zip(buffers(), windows, commits)]
    together_buffers = buffers()
    together = FrameBuffer.extend_all(together_buffers, windows, commits)
    for a, t in zip(alone, together):
        assert torch.equal(a, t)
    assert [b.committed for b in together_buffers] == [2, 6, 4, 7]
    assert FrameBuffer.extend_all([], [], []) == []


def test_a_forked_frame_buffer_reads_the_committed_frames_and_never_writes_them():
    """A stream forked from a voice's state shares the voice's committed frames without a copy; its
    extends write only storage of its own, so the voice and every other fork keep theirs."""
    from cosyserve.models.flow.cache import FrameBuffer

    voice = FrameBuffer(dim=2)
    voice.start_with(torch.arange(12.0).reshape(1, 2, 6), commit=4)
    committed = voice.committed_frames().clone()
    first, second = voice.fork(), voice.fork()
    assert first.committed_frames().data_ptr() == voice.committed_frames().data_ptr()  # no copy at the fork
    out = first.extend(torch.full((1, 2, 3), -1.0), commit=3)
    assert torch.equal(out[:, :, :4], committed) and torch.equal(out[:, :, 4:], torch.full((1, 2, 3), -1.0))
    assert out.data_ptr() != voice.committed_frames().data_ptr()
    out = second.extend(torch.full((1, 2, 1), -2.0), commit=0)  # fits the voice's storage: still not written there
    assert torch.equal(voice._storage, torch.arange(12.0).reshape(1, 2, 6))
    assert torch.equal(out, torch.cat([committed, torch.full((1, 2, 1), -2.0)], dim=2))
    assert first.committed == 7 and second.committed == 4 and voice.committed == 4
