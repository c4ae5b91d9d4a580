"""Text-to-speech over the engine core: requests in, PCM out, for every front door.

:class:`TTSEngine` turns a :class:`~cosyserve.pipeline.tts.TTSRequest` (text, resolved voice,
limits) into an :class:`~.request.EngineRequest`: the text front-end and the prompt ids run on the
caller's thread (a front door's worker, never the loop), then the core takes it. The Triton
front door (:mod:`cosyserve.serving.frontdoor`) hands PCM to Triton's response senders;
:meth:`TTSEngine.stream` and :meth:`TTSEngine.synthesize` are blocking conveniences for in-process
callers (``offline_inference.py``, benchmarks, tests). :func:`load_cosyvoice2_engine` builds the
whole stack on one device: the LLM engine first, so that the flow's state pool is sized from
the memory it leaves, then the token2wav kind, the registered voices' prompt state and CUDA graphs,
so that the first request is as fast as the hundredth.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from ..frontend.speakers import SpeakerRegistry
from ..frontend.torch_models import load_frontend_models
from ..frontend.voice_store import VoiceStore
from ..llm.sampling import REFERENCE_SAMPLING, SamplingParams
from ..pipeline.tts import DEFAULT_SPEAKER, SegmentPrompter, TokenLimits, TTSRequest, VoiceResolver
from ..runtime import SPK2INFO
from ..token2wav.cosyvoice2 import Token2WavOptions, load_token2wav
from ..token2wav.vocoder_stream import SineNoiseProvider
from .core import EngineCore
from .kinds.cosyvoice2 import CosyVoice2Kind
from .request import EngineRequest
from .runners.llm import BackendLLM, LoopLLM
from .scheduler import Scheduler

WARM_UP_TEXT = "你好，欢迎使用语音合成服务。"


class TTSEngine:
    def __init__(self, core: EngineCore, prompter: SegmentPrompter, voices: VoiceResolver) -> None:
        self.core = core
        self.prompter = prompter
        self.voices = voices

    @property
    def sample_rate(self) -> int:
        return self.core.kind.sample_rate

    def submit(self, request: TTSRequest, *, streaming: bool, emit: Callable[[np.ndarray], None],
               finish: Callable[[BaseException | None], None], timeout_s: float = 0.0) -> None:
        """Queue ``request``; its prompts are built here (bad text raises here, as does a refusal:
        CapacityError). ``emit``/``finish`` are then called from the engine's loop thread."""
        segments = list(self.prompter.segment_prompts(request))
        self.core.submit(EngineRequest(request.request_id, iter(segments), request.voice, request.limits, streaming,
                                       emit, finish, timeout_s))

    def cancel(self, request_id: str) -> None:
        self.core.cancel(request_id)

    def stream(self, request: TTSRequest) -> Iterator[np.ndarray]:
        """The request's PCM pieces as they come (blocking); closing the iterator cancels it."""
        pieces: queue.SimpleQueue = queue.SimpleQueue()
        done = object()
        self.submit(request, streaming=True, emit=pieces.put, finish=lambda error: pieces.put((done, error)))
        finished = False
        try:
            while True:
                item = pieces.get()
                if isinstance(item, tuple) and item and item[0] is done:
                    finished = True
                    if item[1] is not None:
                        raise item[1]
                    return
                yield item
        finally:
            if not finished:
                self.cancel(request.request_id)

    def synthesize(self, request: TTSRequest) -> np.ndarray:
        """The whole waveform (blocking): the segments' waveforms concatenated."""
        pieces: list[np.ndarray] = []
        ended: queue.SimpleQueue = queue.SimpleQueue()
        self.submit(request, streaming=False, emit=pieces.append, finish=ended.put)
        error = ended.get()
        if error is not None:
            raise error
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)

    def warm_up(self, streams: tuple[int, ...] = (1, 4), tokens: int = 60) -> None:
        """Voice ``streams[k]`` concurrent requests of ``tokens`` speech tokens (the default voice,
        a short text), one round after the other, and an offline one: every stage of the loop
        (LLM prefill and decode, encoder, window and final steps, HiFT) runs its kernels once."""
        self.prompter.text.warm_up()
        voice = self.voices.resolve()
        limits = TokenLimits(tokens, tokens)
        for count in streams:
            ends: queue.SimpleQueue = queue.SimpleQueue()
            for k in range(count):
                self.submit(TTSRequest(f"warm-up-{count}-{k}", WARM_UP_TEXT, voice, limits), streaming=True,
                            emit=lambda pcm: None, finish=ends.put)
            for _ in range(count):
                if (error := ends.get()) is not None:
                    raise error
        self.synthesize(TTSRequest("warm-up-offline", WARM_UP_TEXT, voice, limits))

    def close(self) -> None:
        self.core.close()


def load_cosyvoice2_engine(model_dir: str | Path, llm_dir: str | Path, device: torch.device, *,
                           flow_dtype: torch.dtype, options: Token2WavOptions, llm_backend=None,
                           llm_options: dict | None = None, sampling: SamplingParams = REFERENCE_SAMPLING,
                           strategy: str = "exponential", scheduler: Scheduler | None = None,
                           voices_dir: Path | None = None, features_file: str | None = None,
                           max_text_chars: int | None = None, sine_noise: SineNoiseProvider | None = None,
                           sync_stages: bool = False, warm_up: bool = False,
                           frontend_backend: str | None = None) -> TTSEngine:
    """The CosyVoice2 stack on ``device``, its loop running. ``llm_backend``: None for our LLM engine
    in the loop (``llm_options``: :class:`~cosyserve.llm.engine.llm_engine.LLMEngine`'s), or a
    :mod:`cosyserve.llm` back end that generates on its own threads (an OpenAI-compatible server).
    ``options`` must have ``incremental_stream``. ``frontend_backend``: the speech tokenizer's and
    speaker encoder's (:func:`~cosyserve.frontend.torch_models.load_frontend_models`; None: PyTorch
    on a GPU, onnxruntime on the CPU). ``warm_up``: capture and compile every shape
    class of the flow, then voice a few requests through the whole loop, before returning (a GPU
    server's ready state: its first request is then as fast as the hundredth)."""
    from transformers import AutoTokenizer

    from ..llm.engine.llm_engine import LLMEngine

    model_dir, llm_dir = Path(model_dir), Path(llm_dir)
    text_tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    registry = SpeakerRegistry.load(model_dir / SPK2INFO)
    if llm_backend is None:
        llm = LoopLLM(LLMEngine(llm_dir, device, **(llm_options or {})), sampling)
    else:
        llm = BackendLLM(llm_backend, sampling)
    llm.register_voices(text_tokenizer, registry)
    model = load_token2wav(model_dir, device, flow_dtype, options)
    kind = CosyVoice2Kind(model, sine_noise)
    for speaker_id in registry.ids()[:kind.flow_engine.max_voices]:
        kind.warm_voice(registry.get(speaker_id).features)
    if warm_up:
        kind.warm_up(registry.get(DEFAULT_SPEAKER).features)
    store = VoiceStore(voices_dir, features_file=features_file) if voices_dir is not None else None
    tokenizer, speaker_encoder = load_frontend_models(model_dir / "speech_tokenizer_v2.onnx", model_dir / "campplus.onnx",
                                                      device, frontend_backend)
    voices = VoiceResolver(registry, tokenizer, speaker_encoder, default_speaker=DEFAULT_SPEAKER, store=store)
    prompter = SegmentPrompter(text_tokenizer, **({} if max_text_chars is None else {"max_text_chars": max_text_chars}))
    core = EngineCore(kind, llm, strategy=strategy, scheduler=scheduler, sync_stages=sync_stages).start()
    engine = TTSEngine(core, prompter, voices)
    if warm_up:
        engine.warm_up()
    return engine
