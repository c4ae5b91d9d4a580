"""CosyVoice3 causal HiFT: parity (vocoder and token2wav composition), incremental streaming, call contract."""

from __future__ import annotations

import pytest
import torch

from cosyserve.config import dump_hyperpyyaml
from cosyserve.errors import InvalidInputError, ModelLoadError
from cosyserve.models.cosyvoice3.config import CausalHiftConfig
from cosyserve.models.cosyvoice3.hift import (FRAME_BUCKETS, CausalHiFTGenerator, CausalHiftStream, bucket_frames,
                                              bucket_rows, load_causal_hift, push_streams, warm_up_shapes)
from cosyserve.parity import cv3_hift, cv3_token2wav


@pytest.fixture(scope="module")
def hift_dir(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("cv3hift")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.save(CausalHiFTGenerator(CausalHiftConfig.tiny()).state_dict(), model_dir / "hift.pt")
    dump_hyperpyyaml({"hift": CausalHiftConfig.tiny().to_yaml_node()}, model_dir / "cosyvoice3.yaml")
    return model_dir


@pytest.fixture(scope="module")
def tiny_hift(hift_dir) -> CausalHiFTGenerator:
    return load_causal_hift(hift_dir)


@pytest.mark.parametrize("suite", [cv3_hift, cv3_token2wav], ids=["cv3_hift", "cv3_token2wav"])
def test_parity(parity_dir, suite):
    fixture_dir = parity_dir / "cosyvoice3"
    if not suite.detect(fixture_dir):
        pytest.skip(f"no {suite.SUITE} fixtures in {fixture_dir}")
    results = suite.run(fixture_dir)
    failed = [r for r in results if not r.passed]
    assert len(results) >= 20 and not failed, failed


def test_incremental_stream_equals_one_final_pass(tiny_hift):
    """Chunks of every size, with windows that start deep inside the utterance, give the samples of
    one final call on the whole mel; non-final pushes hold back 8 frames, the last push none."""
    gen = torch.Generator().manual_seed(3)
    mel = torch.randn(1, 80, 160, generator=gen) * 2 - 4
    expected, _ = tiny_hift.inference(mel, True)
    stream, pieces, start = CausalHiftStream(tiny_hift), [], 0
    for size in (2, 9, 1, 17, 30, 5, 41, 3):
        pieces.append(stream.push(mel[:, :, start:start + size]))
        start += size
        assert sum(p.shape[1] for p in pieces) == 480 * max(0, start - 8)
    pieces.append(stream.push(mel[:, :, start:], finalize=True))
    got = torch.cat(pieces, dim=1)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert stream.mel.shape[2] < 60, "the stream keeps a bounded mel window"


def test_streams_prepared_together_get_what_each_gets_alone(tiny_hift):
    """Streams at different points (a first chunk, a long one, a one-frame one, a final one, one with no
    F0 due) have their F0 and excitation computed in one batched call, rows of different lengths
    left-padded and padding rows added (5 rows: 8): each emits the samples it emits pushed alone."""
    gen = torch.Generator().manual_seed(5)
    mels = [torch.randn(1, 80, 120, generator=gen) * 2 - 4 for _ in range(5)]
    pushes = [[(12, False), (30, False), (50, True)], [(40, False), (1, False), (44, False)],
              [(3, False), (60, False), (2, True)], [(25, False), (25, False), (25, False)],
              [(9, False), (2, False), (70, False)]]
    alone, together = [CausalHiftStream(tiny_hift) for _ in mels], [CausalHiftStream(tiny_hift) for _ in mels]
    starts = [0] * len(mels)
    for step in range(3):
        items, expected = [], []
        for i, mel in enumerate(mels):
            size, final = pushes[i][step]
            piece = mel[:, :, starts[i]:starts[i] + size]
            items.append((together[i], piece, final))
            expected.append(alone[i].push(piece, final))
            starts[i] += size
        for got, want in zip(push_streams(items), expected):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for a, b in zip(alone, together):
        torch.testing.assert_close(b.phase_sum, a.phase_sum, rtol=0, atol=1e-9)
        assert (a.f0_frames, a.emitted, a.finished) == (b.f0_frames, b.emitted, b.finished)


def test_batched_calls_are_padded_to_few_row_counts_and_widths():
    assert [bucket_rows(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 48]
    assert [bucket_frames(n) for n in (1, 16, 17, 47, 65, 200, 256, 257, 600)] == [16, 16, 32, 48, 96, 256, 256,
                                                                                  512, 768]


def _recorded_shapes(hift, monkeypatch) -> set:
    """The shapes of every convolution stack's input from now on: ("f0", rows, frames) and
    ("net", rows, frames, finalize)."""
    seen = set()
    spectrum_from, predict_f0 = hift.spectrum_from, hift.predict_f0
    monkeypatch.setattr(hift, "spectrum_from", lambda mel, spec, final: seen.add(
        ("net", mel.shape[0], mel.shape[2], final)) or spectrum_from(mel, spec, final))
    monkeypatch.setattr(hift, "predict_f0", lambda mel, *a: seen.add(("f0", mel.shape[0], mel.shape[2]))
                        or predict_f0(mel, *a))
    return seen


def test_streams_of_any_lengths_meet_only_the_shapes_warmed_up(tiny_hift, monkeypatch):
    """warm_up_shapes runs each row bucket at each frame bucket; streams pushed together in chunks of
    any sizes (a final chunk's width is set by its reply's length) then meet no other shape while their
    windows stay within its widths: serving builds no cuDNN plan."""
    seen = _recorded_shapes(tiny_hift, monkeypatch)
    warm_up_shapes(tiny_hift, max_rows=5, max_frames=100)
    widths = [w for w in FRAME_BUCKETS if w <= 128]
    assert seen == ({("f0", rows, w) for rows in (1, 2, 4, 8) for w in widths}
                    | {("net", rows, w, final) for rows in (1, 2, 4, 8) for w in widths for final in (False, True)})
    warmed = set(seen)
    seen.clear()
    gen = torch.Generator().manual_seed(8)
    for count, sizes in ((5, (30, 50, 37)), (3, (9, 61, 23)), (1, (44, 1, 70))):
        streams = [CausalHiftStream(tiny_hift) for _ in range(count)]
        for step, size in enumerate(sizes):
            final = step == len(sizes) - 1
            push_streams([(stream, torch.randn(1, 80, size + row, generator=gen), final)
                          for row, stream in enumerate(streams)])
    assert seen and seen <= warmed


def _push_in_chunks(hift, net=None) -> list[torch.Tensor]:
    """5 streams pushed together three times, in chunks of mixed sizes (rows of several widths, F0 windows
    left-padded) and a final push of one frame: every stream's samples, concatenated."""
    gen = torch.Generator().manual_seed(9)
    mels = [(torch.randn(1, 80, 110, generator=gen) * 2 - 4).to(hift.conv_pre.weight.device) for _ in range(5)]
    streams, starts, pieces = [CausalHiftStream(hift) for _ in mels], [0] * 5, [[] for _ in mels]
    for sizes, final in (((30, 30, 30, 12, 45), False), ((30, 9, 61, 40, 2), False), ((1, 50, 1, 20, 1), True)):
        items = []
        for i, (mel, size) in enumerate(zip(mels, sizes)):
            items.append((streams[i], mel[:, :, starts[i]:starts[i] + size], final))
            starts[i] += size
        for i, samples in enumerate(push_streams(items, net)):
            pieces[i].append(samples)
    return [torch.cat(p, dim=1).cpu() for p in pieces]


class _RecordingNetwork:
    """The vocoder's own stacks, each call's (stack, rows, frames) recorded."""

    def __init__(self, hift):
        self.hift, self.calls = hift, []

    def predict_f0(self, mel, finalize, starts=None):
        self.calls.append(("f0", mel.shape[0], mel.shape[2]))
        return self.hift.predict_f0(mel, finalize, starts)

    def spectrum_from(self, mel, spec, finalize):
        self.calls.append(("net", mel.shape[0], mel.shape[2]))
        return self.hift.spectrum_from(mel, spec, finalize)


def test_the_convolution_stacks_run_where_the_caller_says(tiny_hift):
    """push_streams(net=...) runs both stacks, the F0 predictor and the decoder network, through ``net``
    (the engine's CUDA graphs) and nothing else changes; at padded shapes only."""
    net = _RecordingNetwork(tiny_hift)
    got = _push_in_chunks(tiny_hift, net)
    for a, b in zip(got, _push_in_chunks(tiny_hift)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert {stack for stack, _, _ in net.calls} == {"f0", "net"}
    assert all(bucket_rows(rows) == rows and bucket_frames(frames) == frames for _, rows, frames in net.calls)
    assert max(rows for _, rows, _ in net.calls) == 8  # 5 streams together


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_a_gpu_the_vocoder_graphs_replay_the_eager_pushes(hift_dir, monkeypatch):
    """CausalHiftGraphs captures every batched shape at once; streams pushed in chunks of mixed sizes then
    replay them (no eager call of either stack) and get the eager samples (float rounding)."""
    from cosyserve.token2wav.graphs import CausalHiftGraphs

    hift = load_causal_hift(hift_dir, "cuda")
    graphs = CausalHiftGraphs(hift)
    widths = [w for w in FRAME_BUCKETS if w <= bucket_frames(128)]
    assert graphs.precapture(max_rows=5, max_frames=128) == 3 * 4 * len(widths)  # f0, network x2; 1, 2, 4, 8 rows
    expected = _push_in_chunks(hift)
    eager = _recorded_shapes(hift, monkeypatch)
    got = _push_in_chunks(hift, graphs)
    assert not eager, "every call replays a graph"
    assert graphs.num_graphs == 3 * 4 * len(widths)
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_the_excitation_of_rows_at_their_own_frames_equals_each_row_alone(tiny_hift):
    """compute_source with one start frame per row (one row left-padded before frame 0 with F0 0) gives
    each row the excitation and phase sum it gets alone."""
    gen = torch.Generator().manual_seed(6)
    f0 = torch.rand(3, 20, generator=gen) * 300
    f0[2, :4] = 0  # padding: the row's frames start at 4
    phase = torch.rand(3, tiny_hift.m_source.num_harmonics, generator=gen, dtype=torch.float64)
    source, sums = tiny_hift.compute_source(f0, [7, 130, -4], phase)
    for row, (start, cut) in enumerate([(7, 0), (130, 0), (0, 4)]):
        alone, alone_sum = tiny_hift.compute_source(f0[row:row + 1, cut:], start, phase[row:row + 1])
        torch.testing.assert_close(source[row:row + 1, :, cut * 480:], alone, rtol=0, atol=1e-6)
        torch.testing.assert_close(sums[row:row + 1], alone_sum, rtol=0, atol=1e-12)


def test_finished_stream_and_bad_mels_are_rejected(tiny_hift):
    stream = CausalHiftStream(tiny_hift)
    assert stream.push(torch.zeros(1, 80, 3)).shape == (1, 0)
    assert stream.push(torch.zeros(1, 80, 0), finalize=True).shape == (1, 3 * 480)
    with pytest.raises(InvalidInputError, match="finished"):
        stream.push(torch.zeros(1, 80, 4))
    with pytest.raises(InvalidInputError, match="shape"):
        CausalHiftStream(tiny_hift).push(torch.zeros(1, 81, 4))
    with pytest.raises(InvalidInputError, match="shape"):
        tiny_hift.inference(torch.zeros(1, 80, 8), finalize=False)


def test_f0_predictor_runs_in_float64(tiny_hift):
    assert tiny_hift.f0_predictor.classifier.weight.dtype == torch.float64
    assert tiny_hift.conv_pre.weight.dtype == torch.float32
    assert tiny_hift.predict_f0(torch.zeros(1, 80, 5), True).dtype == torch.float32


def test_wrong_checkpoint_is_a_load_error(tmp_path):
    torch.save({"conv_pre.bias": torch.zeros(3)}, tmp_path / "hift.pt")
    with pytest.raises(ModelLoadError, match="does not match"):
        load_causal_hift(tmp_path, config=CausalHiftConfig.tiny())


def test_tiny_bundle_loads_strictly(tmp_path):
    """make_bundle(parts=cosyvoice3) writes the released file names; both token2wav models load strictly
    from them with the configs the yaml describes, and run."""
    from cosyserve.bundle import make_bundle
    from cosyserve.bundle.cosyvoice3 import COSYVOICE3_DIR
    from cosyserve.config import load_hyperpyyaml
    from cosyserve.models.cosyvoice3.config import Cv3FlowConfig
    from cosyserve.models.cosyvoice3.flow import load_cosyvoice3_flow

    model_dir = make_bundle(tmp_path, "tiny", seed=0, parts=("cosyvoice3",)) / COSYVOICE3_DIR
    # the released names: the token2wav checkpoints and the front-end's ONNX models
    assert sorted(p.name for p in model_dir.iterdir()) == ["campplus.onnx", "cosyvoice3.yaml", "flow.pt", "hift.pt",
                                                           "speech_tokenizer_v3.onnx"]
    tree = load_hyperpyyaml(model_dir / "cosyvoice3.yaml")
    assert Cv3FlowConfig.from_yaml_tree(tree) == Cv3FlowConfig.tiny()
    assert CausalHiftConfig.from_yaml_tree(tree) == CausalHiftConfig.tiny()
    assert tree["llm"].target == "cosyvoice.llm.llm.CosyVoice3LM"
    flow, hift = load_cosyvoice3_flow(model_dir), load_causal_hift(model_dir)
    assert all(v.dtype == torch.float32 for v in torch.load(model_dir / "hift.pt", weights_only=True).values())
    tokens = torch.randint(0, 6561, (1, 12), generator=torch.Generator().manual_seed(0))
    mel = flow.inference(tokens, tokens[:, :4], torch.zeros(1, 8, 80), torch.ones(1, 192), streaming=False,
                         finalize=True)
    speech, _ = hift.inference(mel, True)
    assert mel.shape == (1, 80, 24) and speech.shape == (1, 24 * 480) and torch.isfinite(speech).all()
