"""New clips' front end as a batched job: the models' shape buckets (a call padded to its bucket gives
each clip what it gives alone; on CUDA the replayed graphs equal the eager models) and the
:class:`PromptFeaturizer` (concurrent clips share calls; a bad clip fails only its own caller)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from cosyserve.audio.io import TOKENIZER_SAMPLE_RATE, PromptAudio, prompt_audio_from_array
from cosyserve.bundle import synthetic_prompt_wave
from cosyserve.bundle.onnx_models import write_campplus_onnx, write_speech_tokenizer_onnx
from cosyserve.errors import InvalidInputError
from cosyserve.frontend.featurizer import PromptFeaturizer
from cosyserve.frontend.graphs import GRAPH_BATCHES, GRAPH_SECONDS, ClipGraphs
from cosyserve.frontend.prompt import build_prompt_features
from cosyserve.frontend.torch_models import TorchSpeakerEncoder, TorchSpeechTokenizer

torch.set_num_threads(1)


def clip(seconds: float, seed: int) -> torch.Tensor:
    return torch.from_numpy(synthetic_prompt_wave(seconds, seed=seed).astype(np.float32))


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("frontend")
    return (write_speech_tokenizer_onnx(root / "speech_tokenizer_v2.onnx", "tiny", seed=11),
            write_campplus_onnx(root / "campplus.onnx", "tiny", seed=12))


def assert_codes_match(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Codes of two different computations: as many, and equal but for one on a rounding edge in a
    hundred (float sums may differ in their last bit by CPU or by kernel)."""
    assert tokens.shape == expected.shape
    assert int((tokens != expected).sum()) <= max(1, expected.numel() // 100), (tokens, expected)


def bucket_call(clips: list[torch.Tensor], batch: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What :class:`ClipGraphs` feeds a graph: clips zero-padded to ``samples``, then silent padding
    clips as long as the bucket, up to ``batch``."""
    wav = torch.zeros(batch, samples)
    lengths = torch.full((batch,), samples, dtype=torch.int64)
    for i, c in enumerate(clips):
        wav[i, :c.numel()] = c
        lengths[i] = c.numel()
    return wav, lengths


def test_buckets_cover_every_prompt_clip():
    graphs = ClipGraphs.__new__(ClipGraphs)  # shape_of reads no device state
    assert graphs.shape_of(1, 8000) == (1, 2 * TOKENIZER_SAMPLE_RATE)
    assert graphs.shape_of(3, 3 * TOKENIZER_SAMPLE_RATE + 1) == (4, 4 * TOKENIZER_SAMPLE_RATE)
    assert graphs.shape_of(8, 30 * TOKENIZER_SAMPLE_RATE) == (8, 30 * TOKENIZER_SAMPLE_RATE)
    assert graphs.shape_of(9, 16000) is None and graphs.shape_of(1, 30 * TOKENIZER_SAMPLE_RATE + 1) is None
    assert GRAPH_BATCHES[-1] == 8 and GRAPH_SECONDS[-1] == 30


@torch.inference_mode()
def test_a_call_padded_to_its_bucket_gives_each_clip_what_it_gives_alone(model_files):
    tokenizer, encoder = TorchSpeechTokenizer(model_files[0]), TorchSpeakerEncoder(model_files[1])
    clips = [clip(seconds, seed) for seed, seconds in enumerate((0.7, 2.9, 4.4))]
    wav, lengths = bucket_call(clips, 4, 5 * TOKENIZER_SAMPLE_RATE)
    codes, counts = tokenizer.forward(wav, lengths)
    embeddings = encoder.forward(wav, lengths)
    for i, c in enumerate(clips):
        alone = tokenizer.tokenize(c)
        assert int(counts[i]) == alone.numel()
        assert_codes_match(codes[i, :alone.numel()], alone)
        torch.testing.assert_close(embeddings[i], encoder.embed(c), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replays_equal_the_eager_models_on_cuda(model_files):
    eager = TorchSpeechTokenizer(model_files[0], "cuda", cuda_graphs=False), \
        TorchSpeakerEncoder(model_files[1], "cuda", cuda_graphs=False)
    graphed = TorchSpeechTokenizer(model_files[0], "cuda"), TorchSpeakerEncoder(model_files[1], "cuda")
    clips = [clip(seconds, seed) for seed, seconds in enumerate((0.7, 2.9, 4.4, 11.0, 3.3))]
    for batch in ([clips[0]], clips[:3], clips):
        for ours, reference in zip(graphed[0].tokenize_batch(batch), eager[0].tokenize_batch(batch)):
            assert_codes_match(ours, reference)
        for ours, reference in zip(graphed[1].embed_batch(batch), eager[1].embed_batch(batch)):
            torch.testing.assert_close(ours, reference, rtol=1e-3, atol=1e-4)
    assert graphed[0].graphs.captured == 3 and graphed[1].graphs.captured == 3


class CountingModels:
    """A tokenizer and a speaker encoder in one that count calls and clips (CPU tensors out)."""

    def __init__(self):
        self.calls = 0
        self.gate = threading.Event()
        self.gate.set()

    def tokenize_batch(self, wavs16):
        self.gate.wait()
        self.calls += 1
        return [torch.arange(wav.numel() * 25 // TOKENIZER_SAMPLE_RATE, dtype=torch.int32) % 6561 for wav in wavs16]

    def embed_batch(self, wavs16):
        if any(float(wav.abs().max()) > 0.95 for wav in wavs16):
            raise RuntimeError("a clip this encoder cannot take")
        return [torch.full((192,), float(wav[0])) for wav in wavs16]


class Launched:
    """A batch call as the front-end models' ``start_batch`` (results when the caller waits)."""

    def __init__(self, batch_call):
        self.batch_call = batch_call

    def start_batch(self, wavs16):
        results = self.batch_call(wavs16)
        return lambda: results


def featurizer_of(models: CountingModels) -> PromptFeaturizer:
    return PromptFeaturizer(Launched(models.tokenize_batch), Launched(models.embed_batch))


def audio(seed: int, seconds: float = 1.0, peak: float = 0.5):
    wav = np.random.default_rng(seed).uniform(-peak, peak, int(TOKENIZER_SAMPLE_RATE * seconds)).astype(np.float32)
    return prompt_audio_from_array(wav, TOKENIZER_SAMPLE_RATE)


def resolve_together(featurizer: PromptFeaturizer, audios: list) -> list:
    results: list = [None] * len(audios)

    def one(i: int) -> None:
        try:
            results[i] = featurizer.features(audios[i])
        except Exception as exc:
            results[i] = exc
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(audios))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_clips_arriving_together_share_one_call_and_get_their_own_features():
    models = CountingModels()
    featurizer = featurizer_of(models)
    audios = [audio(seed) for seed in range(6)]
    models.gate.clear()  # the first batch waits in the models: the others queue behind it
    threading.Timer(0.2, models.gate.set).start()
    results = resolve_together(featurizer, audios)
    assert featurizer.clips == 6 and featurizer.batches < 6 and models.calls == featurizer.batches
    for features, a in zip(results, audios):
        expected = build_prompt_features(a, _Single(models), _Single(models))
        assert torch.equal(features.speech_tokens, expected.speech_tokens)
        assert torch.equal(features.embedding, expected.embedding)
        torch.testing.assert_close(features.speech_feat, expected.speech_feat)


def test_a_burst_of_clips_is_one_call_told_before_its_callers_are_answered():
    """Clips that keep arriving close together (here 20 ms apart, within a gather of 200 ms) share one
    call, though the models are idle when the first comes; ``on_features`` gets that batch's features
    (the very objects its callers then get) before any caller has them: the engine starts on a burst's
    voices at once, together."""
    models = CountingModels()
    featurizer = PromptFeaturizer(Launched(models.tokenize_batch), Launched(models.embed_batch), gather_s=0.2,
                                  gather_max_s=5.0)
    told: list = []
    results: list = []
    featurizer.on_features = lambda features: told.append((list(features), len(results)))
    threads = [threading.Thread(target=lambda a=audio(seed): results.append(featurizer.features(a)))
               for seed in range(4)]
    for thread in threads:
        thread.start()
        time.sleep(0.02)
    for thread in threads:
        thread.join()
    assert len(results) == 4 and featurizer.batches == 1 == models.calls
    assert len(told) == 1 and told[0][1] == 0
    assert sorted(map(id, told[0][0])) == sorted(map(id, results))


def test_a_batch_waits_for_clips_announced_and_not_yet_queued():
    """A clip its caller has announced (still preparing it on its own thread) joins the batch of a clip
    queued before it, the gap long past; an announcement given up, or held past announced_max_s, holds
    a batch no longer."""
    models = CountingModels()
    featurizer = PromptFeaturizer(Launched(models.tokenize_batch), Launched(models.embed_batch), gather_s=0.002,
                                  gather_max_s=0.01, announced_max_s=5.0)
    results: list = []
    announced = threading.Event()

    def late(queue_it: bool, hold_s: float) -> None:
        with featurizer.arrival() as arrival:
            announced.set()
            time.sleep(hold_s)  # decoding and resampling, as it were
            if queue_it:
                results.append(featurizer.features(audio(1), arrival))

    def first_beside(queue_it: bool, hold_s: float) -> float:
        announced.clear()
        thread = threading.Thread(target=late, args=(queue_it, hold_s))
        thread.start()
        announced.wait()
        began = time.monotonic()
        results.append(featurizer.features(audio(0)))
        waited = time.monotonic() - began
        thread.join()
        return waited

    first_beside(True, 0.1)
    assert len(results) == 2 and featurizer.batches == 1 and featurizer.clips == 2
    waited = first_beside(False, 0.1)  # given up after 0.1 s: the batch goes then, alone
    assert 0.08 < waited < 2.0 and featurizer.batches == 2 and featurizer.clips == 3
    featurizer.announced_max_s = 0.05
    waited = first_beside(False, 1.0)  # held longer than the batch may wait
    assert waited < 0.5 and featurizer.batches == 3


def test_a_clip_that_fails_in_a_batch_fails_only_its_caller():
    models = CountingModels()
    featurizer = featurizer_of(models)
    audios = [audio(0), audio(1, peak=0.99), audio(2)]  # the second: the encoder refuses it
    results = resolve_together(featurizer, audios)
    assert isinstance(results[1], RuntimeError)
    assert all(not isinstance(r, Exception) for r in (results[0], results[2]))
    with pytest.raises(InvalidInputError):  # checked on the caller's thread, never batched
        featurizer.features(PromptAudio(wav16=torch.full((150,), 0.1), source=torch.full((150,), 0.1), source_rate=16000))


class _Single:
    """One clip at a time through batch models: the reference the featurizer's batches must equal."""

    def __init__(self, models):
        self.models = models

    def tokenize(self, wav16):
        return self.models.tokenize_batch([wav16])[0]

    def embed(self, wav16):
        return self.models.embed_batch([wav16])[0]
