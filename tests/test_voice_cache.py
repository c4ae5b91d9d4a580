"""VoiceResolver's cache of prompt features: a repeated reference clip skips the front-end models."""

import numpy as np
import pytest
import torch

from cosyserve.engine.front_end import VoiceResolver

RATE = 16000


class CountingTokenizer:
    def __init__(self):
        self.calls = 0

    def start_batch(self, wavs16):  # the front-end models' interface: results when the caller waits
        self.calls += len(wavs16)
        codes = [torch.arange(wav16.numel() * 25 // RATE, dtype=torch.int32) % 6561 for wav16 in wavs16]
        return lambda: codes


class CountingEncoder:
    def __init__(self):
        self.calls = 0

    def start_batch(self, wavs16):
        self.calls += len(wavs16)
        embeddings = [torch.full((192,), float(wav16[0])) for wav16 in wavs16]
        return lambda: embeddings


class OneSpeaker:
    def get(self, speaker_id):
        return object()


def clip(seed: int, seconds: float = 1.0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, int(RATE * seconds)).astype(np.float32)


@pytest.fixture
def frontends():
    return CountingTokenizer(), CountingEncoder()


def test_repeated_clip_runs_the_front_ends_once(frontends):
    tokenizer, encoder = frontends
    voices = VoiceResolver(OneSpeaker(), tokenizer, encoder)
    first = voices.resolve(clip(1), "hello")
    again = voices.resolve(clip(1).copy(), "another transcript")  # same samples, new array and text
    assert (tokenizer.calls, encoder.calls) == (1, 1)
    assert again.prompt_text == "another transcript"
    assert torch.equal(again.features.speech_tokens, first.features.speech_tokens)
    voices.resolve(clip(2), "hello")
    assert (tokenizer.calls, encoder.calls) == (2, 2)
    assert voices.cached_clips == 2


def test_cache_keeps_the_most_recent_clips(frontends):
    tokenizer, _ = frontends
    voices = VoiceResolver(OneSpeaker(), tokenizer, frontends[1], feature_cache_size=2)
    for seed in (1, 2, 1, 3):  # 1 was used after 2, so 2 is the one evicted by 3
        voices.resolve(clip(seed), "x")
    assert tokenizer.calls == 3 and voices.cached_clips == 2
    voices.resolve(clip(1), "x")
    assert tokenizer.calls == 3
    voices.resolve(clip(2), "x")
    assert tokenizer.calls == 4


def test_cache_size_zero_disables_it(frontends):
    tokenizer, encoder = frontends
    voices = VoiceResolver(OneSpeaker(), tokenizer, encoder, feature_cache_size=0)
    for _ in range(2):
        voices.resolve(clip(1), "x")
    assert (tokenizer.calls, encoder.calls) == (2, 2) and voices.cached_clips == 0


def test_invalid_clip_is_rejected_and_not_cached(frontends):
    voices = VoiceResolver(OneSpeaker(), *frontends)
    with pytest.raises(ValueError):
        voices.resolve(np.zeros(RATE, np.float32), "silence")
    assert voices.cached_clips == 0


def test_clip_cache_counts_and_keys_on_samples_dtype_and_shape():
    from cosyserve.clip_cache import ClipCache

    cache = ClipCache(4)
    computed = []

    def value(tag):
        computed.append(tag)
        return tag

    a = clip(1)
    assert cache.get_or_compute(a, lambda: value("a")) == "a"
    assert cache.get_or_compute(torch.from_numpy(a.copy()), lambda: value("again")) == "a"  # tensor, same samples
    assert cache.get_or_compute(a.astype(np.float64), lambda: value("f64")) == "f64"  # other dtype: other clip
    assert cache.get_or_compute(a.reshape(2, -1), lambda: value("2d")) == "2d"  # other shape: other clip
    assert computed == ["a", "f64", "2d"] and (cache.hits, cache.misses) == (1, 3)
    with pytest.raises(ValueError):
        ClipCache(-1)


def test_clip_cache_computes_the_misses_of_a_batch_in_one_call():
    from cosyserve.clip_cache import ClipCache

    cache = ClipCache(3)
    calls = []

    def compute(clips):
        calls.append(len(clips))
        return [float(c[0]) for c in clips]

    a, b, c = clip(1), clip(2), clip(3)
    assert cache.get_or_compute_batch([a, b, a], compute) == [float(a[0]), float(b[0]), float(a[0])]
    assert cache.get_or_compute_batch([b, c], compute) == [float(b[0]), float(c[0])]
    assert calls == [2, 1] and (cache.hits, cache.misses) == (2, 3)  # a repeated in a batch is computed once
    assert ClipCache(0).get_or_compute_batch([a, a], compute) == [float(a[0])] * 2 and calls[-1] == 2
