"""New clips -> prompt features, as a batched job: clips that arrive together (each within
:data:`~cosyserve.runtime.BURST_GAP_S` of the one before) share one speech tokenizer call and one
CAM++ call, and clips that arrive while a batch runs share the next.

A server's voices are resolved on many threads at once (a front door's prepare threads, the API's
workers); each new clip's models run here, on one thread of their own, so that a burst of new callers
makes a few batched calls (:data:`DEFAULT_MAX_BATCH` clips each) rather than one call per caller, all
of them contending for the device and the GIL. A lone clip waits that long for company; a burst
is one call, not a first clip alone and then the rest (8 new clips on an H100: the first alone at
7 ms, the other 7 only once it was done, at 16-42 ms, and their voices' flow prompts then ran as two
solves, one after the other). With the PyTorch back end on CUDA the models replay CUDA
graphs on a stream of their own (:mod:`.torch_models`), never the engine's, and the prompt mel is
computed on that device and stream too; on the CPU (onnxruntime) the same batching only saves the
queueing.

A caller announces its clip as it starts on it (:meth:`PromptFeaturizer.arrival`): decoding,
validation and resampling run on the caller's thread under the GIL, so a burst's clips reach the queue
spread over ~15 ms (8 new clips on an H100: the first two alone, the other six in a second batch, their
LLM prefills and first flow windows then a wave later, ~170 ms). A batch waits for clips announced and
not yet queued, up to ``announced_max_s`` after its first; a lone clip, with none announced, waits only
the gap.

A clip is checked on its caller's thread before it joins a batch (a bad clip fails its own request
and no other); a batch that still fails is run again clip by clip, so an error reaches only the
request whose clip caused it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Iterator

import torch

from ..audio.io import PromptAudio
from ..runtime import BURST_GAP_S, BURST_MAX_S
from .onnx_models import speaker_input, tokenizer_input
from .prompt import COSYVOICE2_MEL_FMAX, PromptFeatures, build_prompt_features_batch, warm_device_prompt_mel

log = logging.getLogger(__name__)

# The most clips per batch.
DEFAULT_MAX_BATCH = 8
# How long after its first clip a batch may wait for clips announced and not yet queued.
ANNOUNCED_MAX_S = 0.03


class Arrival:
    """A clip a caller has started on and not yet queued (or given up on): counted by its featurizer."""

    def __init__(self, featurizer: "PromptFeaturizer") -> None:
        self._featurizer = featurizer
        self._pending = True

    def arrived(self) -> None:
        """Queued, or given up (a clip that failed its checks, or whose features were cached): no longer awaited."""
        if self._pending:
            self._pending = False
            self._featurizer._announce(-1)


class PromptFeaturizer:
    """``features(audio)`` (blocking, any thread) of new clips through ``tokenizer`` and
    ``speaker_encoder`` (their ``start_batch``; their ``device`` and ``stream``, where they
    have them, also compute the prompt mel)."""

    def __init__(self, tokenizer, speaker_encoder, mel_fmax: float | None = COSYVOICE2_MEL_FMAX, *,
                 max_batch: int = DEFAULT_MAX_BATCH, gather_s: float = BURST_GAP_S,
                 gather_max_s: float = BURST_MAX_S, announced_max_s: float = ANNOUNCED_MAX_S) -> None:
        self.tokenizer = tokenizer
        self.speaker_encoder = speaker_encoder
        self.mel_fmax = mel_fmax
        self.max_batch = max_batch
        self.gather_s, self.gather_max_s, self.announced_max_s = gather_s, gather_max_s, announced_max_s
        self.device = getattr(tokenizer, "device", torch.device("cpu"))
        self.stream = getattr(tokenizer, "stream", None)
        self.batches = 0  # calls of the models, and the clips they took
        self.clips = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._announced = 0  # clips of Arrivals not yet queued
        # told of each batch's features before its callers are answered (on this object's thread): the
        # engine starts on those voices then (EngineCore.voices_arriving), not as each request arrives
        self.on_features: Callable[[list[PromptFeatures]], None] | None = None

    @contextmanager
    def arrival(self) -> Iterator[Arrival]:
        """Announce a clip this thread is about to prepare and pass to :meth:`features` (with the
        Arrival): batches gathering meanwhile wait for it. It is no longer awaited once queued, or when
        the block ends without it (an invalid clip, cached features)."""
        arrival = Arrival(self)
        self._announce(1)
        try:
            yield arrival
        finally:
            arrival.arrived()

    def _announce(self, change: int) -> None:
        with self._lock:
            self._announced += change

    def features(self, audio: PromptAudio, arrival: Arrival | None = None) -> PromptFeatures:
        tokenizer_input(audio.wav16)
        speaker_input(audio.wav16)
        answer: Future = Future()
        self._queue.put((audio, answer))
        if arrival is not None:  # after the put: a gathering batch sees it queued or still announced
            arrival.arrived()
        self._ensure_thread()
        return answer.result()

    def warm_up(self) -> None:
        """Capture the models' graphs (where they have them) and make the device prompt mel's FFT
        plans at load, not on a first clip of each shape."""
        for model in (self.tokenizer, self.speaker_encoder):
            capture = getattr(model, "capture_all", None)
            if capture is not None:
                capture()
        if self.device.type == "cuda":
            with torch.cuda.stream(self.stream), torch.inference_mode():
                warm_device_prompt_mel(self.device, self.mel_fmax)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="prompt-features", daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        while True:
            batch = [self._queue.get()]
            first = time.monotonic()
            last_by, announced_by = first + self.gather_max_s, first + self.announced_max_s
            while len(batch) < self.max_batch:  # those that came while the last batch ran, and the burst's
                awaited = self._announced > 0 and time.monotonic() < announced_by
                until = announced_by if awaited else last_by
                try:
                    batch.append(self._queue.get(timeout=max(0.0, min(self.gather_s, until - time.monotonic()))))
                except queue.Empty:
                    if not awaited:  # (an announcement ended during the wait: the next pass finds none)
                        break
            self._answer(batch)

    def _answer(self, batch: list[tuple[PromptAudio, Future]]) -> None:
        try:
            results = self._compute([audio for audio, _ in batch])
        except Exception as exc:
            if len(batch) > 1:  # find the clip at fault: each alone
                for item in batch:
                    self._answer([item])
                return
            batch[0][1].set_exception(exc)
            return
        if self.on_features is not None:
            try:
                self.on_features(results)
            except Exception:  # the requests still bring their voices
                log.exception("prompt features: on_features failed")
        for (_, answer), features in zip(batch, results):
            answer.set_result(features)

    def _compute(self, audios: list[PromptAudio]) -> list[PromptFeatures]:
        self.batches += 1
        self.clips += len(audios)
        return build_prompt_features_batch(audios, self.tokenizer, self.speaker_encoder, self.mel_fmax,
                                           device=self.device, stream=self.stream)
