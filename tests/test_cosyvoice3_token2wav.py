"""CosyVoice3 token2wav behind the Token2Wav interface (tiny random bundle, CPU).

Streaming through the pipeline's chunk schedule gives 960 samples per token and equals the
block-masked flow run once over all tokens then vocoded in one call (what the incremental streams
compute chunk by chunk), or, with ``incremental=False``, the reference's full-attention re-runs over
each prefix; sessions close on finalize, cancel, error and idle.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from cosyserve.audio.io import prompt_audio_from_array
from cosyserve.bundle import make_bundle, synthetic_prompt_wave
from cosyserve.bundle.cosyvoice3 import SPEAKER_ENCODER_FILE, SPEECH_TOKENIZER_FILE
from cosyserve.errors import InvalidInputError
from cosyserve.frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
from cosyserve.frontend.prompt import COSYVOICE3_MEL_FMAX, Voice, build_prompt_features
from cosyserve.runtime import COSYVOICE3_DIR
from cosyserve.schedule import ChunkScheduler
from cosyserve.token2wav.cosyvoice3 import Cv3WindowGraphs, load_cosyvoice3_token2wav
from cosyserve.token2wav.graphs import frame_bucket

SAMPLES_PER_TOKEN = 960


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("cv3t2w"), "tiny", parts=("cosyvoice3",)) / COSYVOICE3_DIR


@pytest.fixture(scope="module")
def voice(model_dir):
    audio = prompt_audio_from_array(synthetic_prompt_wave(seconds=2.0), 16000)
    features = build_prompt_features(audio, SpeechTokenizer(model_dir / SPEECH_TOKENIZER_FILE),
                                     SpeakerEncoder(model_dir / SPEAKER_ENCODER_FILE), COSYVOICE3_MEL_FMAX)
    return Voice("a prompt transcript", features)


@pytest.fixture()
def t2w(model_dir):
    return load_cosyvoice3_token2wav(model_dir)


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stream(t2w, request_id: str, ids: list[int], voice) -> list[np.ndarray]:
    scheduler, chunks = ChunkScheduler("exponential"), []
    while (chunk := scheduler.next_chunk(len(ids))) is not None:
        chunks.append(t2w.step(request_id, ids[:chunk.num_tokens], voice, chunk.token_offset, False))
    final = scheduler.final_chunk(len(ids))
    chunks.append(t2w.step(request_id, ids, voice, final.token_offset, True))
    return chunks


def rel_l2(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_cosyvoice3_prompt_mel_uses_the_nyquist_band(voice, model_dir):
    audio = prompt_audio_from_array(synthetic_prompt_wave(seconds=2.0), 16000)
    cv2 = build_prompt_features(audio, SpeechTokenizer(model_dir / SPEECH_TOKENIZER_FILE),
                                SpeakerEncoder(model_dir / SPEAKER_ENCODER_FILE))
    assert voice.features.speech_feat.shape == cv2.speech_feat.shape
    assert not torch.allclose(voice.features.speech_feat, cv2.speech_feat)


@pytest.mark.parametrize("n", [10, 60, 130])
def test_streaming_gives_960_samples_per_token_and_equals_one_block_masked_pass(t2w, voice, n):
    ids = tokens(n, seed=n)
    chunks = stream(t2w, f"r{n}", ids, voice)
    assert sum(c.size for c in chunks) == SAMPLES_PER_TOKEN * n
    assert t2w.open_sessions == 0
    f = voice.features
    with torch.inference_mode():
        mel = t2w.flow.inference(torch.tensor([ids]), f.speech_tokens.reshape(1, -1).long(),
                                 f.speech_feat.reshape(1, -1, 80), f.embedding.reshape(1, -1),
                                 streaming=True, finalize=True)
        whole = t2w.hift.inference(mel, finalize=True)[0].reshape(-1).numpy()
    assert rel_l2(np.concatenate(chunks), whole) < 1e-2
    assert np.abs(np.concatenate(chunks)).max() <= 0.99 + 1e-6


@pytest.mark.parametrize("n", [10, 60])
def test_the_reference_re_run_streams_its_full_attention_prefix_passes(model_dir, voice, n):
    """incremental=False: each step re-runs the full-attention flow over every token so far and sends
    the frames after those already sent, as the reference Triton runtime does; vocoded once, those
    frames give the stream's audio (960 samples per token)."""
    t2w = load_cosyvoice3_token2wav(model_dir, incremental=False)
    ids = tokens(n, seed=n + 1)
    chunks = stream(t2w, f"rerun{n}", ids, voice)
    assert sum(c.size for c in chunks) == SAMPLES_PER_TOKEN * n and t2w.open_sessions == 0
    f = voice.features
    prompt = (f.speech_tokens.reshape(1, -1).long(), f.speech_feat.reshape(1, -1, 80), f.embedding.reshape(1, -1))
    scheduler, pieces, sent = ChunkScheduler("exponential"), [], 0
    plan = []
    while (chunk := scheduler.next_chunk(len(ids))) is not None:
        plan.append((chunk.num_tokens, False))
    plan.append((len(ids), True))
    with torch.inference_mode():
        for count, finalize in plan:
            mel = t2w.flow.inference(torch.tensor([ids[:count]]), *prompt, streaming=False, finalize=finalize)
            pieces.append(mel[:, :, sent:])
            sent = max(sent, mel.shape[2])
        whole = t2w.hift.inference(torch.cat(pieces, dim=2), finalize=True)[0].reshape(-1).numpy()
    assert rel_l2(np.concatenate(chunks), whole) < 1e-2


def test_streams_of_one_voice_share_its_prompt_only_flow_states(model_dir, voice):
    """The first stream of a voice samples its prompt-only blocks apart and keeps them; the next
    streams start after them, with the same audio as a token2wav that keeps nothing; another voice
    misses; the least recently used voice goes past ``voice_prefixes``."""
    plain, cached = (load_cosyvoice3_token2wav(model_dir, voice_prefixes=k) for k in (0, 1))
    assert cached.flow.voice_prefix_frames(voice.features.speech_tokens.numel()) > 0
    ids = tokens(60, seed=5)
    expected = np.concatenate(stream(plain, "p", ids, voice))
    first = np.concatenate(stream(cached, "a", ids, voice))
    second = np.concatenate(stream(cached, "b", ids, voice))
    assert (cached.prefix_misses, cached.prefix_hits, cached.cached_voices) == (1, 1, 1)
    assert rel_l2(first, expected) < 1e-5 and rel_l2(second, expected) < 1e-5
    assert (plain.prefix_misses, plain.prefix_hits, plain.cached_voices) == (0, 0, 0)
    f = voice.features
    other = Voice("another transcript", type(f)(f.speech_tokens, f.speech_feat * 0.5, f.embedding))
    assert np.concatenate(stream(cached, "c", ids, other)).size == SAMPLES_PER_TOKEN * 60
    assert (cached.prefix_misses, cached.prefix_hits, cached.cached_voices) == (2, 1, 1)  # the first voice went
    stream(cached, "d", ids, voice)
    assert cached.prefix_misses == 3


def test_padded_windows_equal_the_eager_ones(model_dir, voice):
    """The CUDA-graph sampler pads every window and the committed keys/values to bucketed shapes in
    buffers shared by all shapes; run eagerly (``cuda_graphs=False``), the padding changes no sample:
    padded keys are masked, padded frames follow the real ones and are dropped."""
    eager, padded = (load_cosyvoice3_token2wav(model_dir, voice_prefixes=1) for _ in range(2))
    sampler = padded.window_graphs = Cv3WindowGraphs(padded.flow.decoder, cuda_graphs=False,
                                                     max_past=1000, max_window=300)
    ids = tokens(260, seed=7)  # windows from frame 450 on: committed frames padded too (450 -> 500)
    assert frame_bucket(450) == 500
    expected = np.concatenate(stream(eager, "e", ids, voice))
    for request in ("first", "second"):  # the second stream starts after the voice's kept prefix
        assert rel_l2(np.concatenate(stream(padded, request, ids, voice)), expected) < 1e-5
    assert sampler.calls > 0 and sampler.eager_calls == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a capture that fails: no CUDA")
def test_a_failed_capture_runs_that_shape_eagerly(model_dir, voice, caplog):
    """A window graph whose capture fails (here: no CUDA at all) costs speed, not the request."""
    eager, fallback = (load_cosyvoice3_token2wav(model_dir) for _ in range(2))
    sampler = fallback.window_graphs = Cv3WindowGraphs(fallback.flow.decoder, max_past=1000)
    ids = tokens(60, seed=3)
    expected = np.concatenate(stream(eager, "e", ids, voice))
    assert rel_l2(np.concatenate(stream(fallback, "f", ids, voice)), expected) < 1e-6
    assert sampler.num_graphs == 0 and sampler.eager_calls == sampler.calls > 0
    assert "runs eagerly" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_window_graphs_replay_the_eager_windows(model_dir, voice):
    eager = load_cosyvoice3_token2wav(model_dir, "cuda")
    graphed = load_cosyvoice3_token2wav(model_dir, "cuda", cuda_graphs=True)
    ids = tokens(130, seed=7)
    expected = np.concatenate(stream(eager, "e", ids, voice))
    for request in ("capture", "replay"):  # a shape is captured when first seen
        assert rel_l2(np.concatenate(stream(graphed, request, ids, voice)), expected) < 1e-4
    assert graphed.window_graphs.num_graphs > 0 and graphed.window_graphs.eager_calls == 0


def test_offline_is_the_full_attention_pass(t2w, voice):
    ids = tokens(40, seed=1)
    wave = t2w.offline("o", ids, voice)
    assert wave.size == SAMPLES_PER_TOKEN * 40 and np.isfinite(wave).all()
    with pytest.raises(InvalidInputError, match="no speech tokens"):
        t2w.offline("o", [], voice)


def test_sessions_close_on_cancel_error_and_idle(t2w, voice):
    ids = tokens(60, seed=2)
    assert t2w.step("c", ids[:18], voice, 0, False).size > 0
    assert t2w.open_sessions == 1
    t2w.cancel("c")
    assert t2w.open_sessions == 0
    t2w.cancel("c")  # harmless twice

    t2w.step("e", ids[:18], voice, 0, False)
    with pytest.raises(InvalidInputError, match="speech tokens must be in 0..6560"):
        t2w.step("e", ids[:30] + [6561], voice, 15, False)
    assert t2w.open_sessions == 0
    t2w.step("e2", ids[:18], voice, 0, False)
    with pytest.raises(InvalidInputError, match="send all tokens so far"):
        t2w.step("e2", ids[:10], voice, 15, False)
    assert t2w.open_sessions == 0

    t2w.idle_timeout_s = 0.05
    t2w.step("idle", ids[:18], voice, 0, False)
    time.sleep(0.1)
    assert t2w.close_idle() == ["idle"] and t2w.open_sessions == 0
    # The same id starts afresh after its session was closed: a full stream gives 960 samples per token.
    t2w.idle_timeout_s = 600
    assert sum(c.size for c in stream(t2w, "idle", ids, voice)) == SAMPLES_PER_TOKEN * 60
