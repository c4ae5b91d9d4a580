"""Text-to-speech over the engine core: requests in, PCM out, for every front door.

:class:`TTSEngine` turns a :class:`~cosyserve.engine.front_end.TTSRequest` (text, resolved voice,
limits) into an :class:`~.request.EngineRequest`: the text front-end and the prompt ids run on the
caller's thread (a front door's worker, never the loop), then the core takes it: the
:class:`~.core.EngineCore` in this process, or an engine process through its
:class:`~.client.EngineClient` (what the servers use). The Triton front door
(:mod:`cosyserve.serving.frontdoor`) hands PCM to Triton's response senders; :meth:`TTSEngine.stream`
and :meth:`TTSEngine.synthesize` are blocking conveniences (``offline_inference.py``, benchmarks,
tests). :func:`load_engine` builds the whole stack of one model kind (:data:`MODEL_KINDS`:
CosyVoice2, CosyVoice3, Step-Audio2) on one device: the LLM engine first, so that the flow's state
is sized from the memory it leaves, then the token2wav kind, the kept voices' prompt state and CUDA
graphs, so that the first request is as fast as the hundredth. :func:`load_frontend` builds the
front-end half alone (text, prompts, voices) for a front door whose engine runs elsewhere. The kinds
differ in their modules, prompt layouts and front-end files only; requests, scheduling, admission
and the loop are one.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..audio.features import TOKENIZER_SAMPLE_RATE
from ..frontend.prompt import COSYVOICE2_MEL_FMAX, COSYVOICE3_MEL_FMAX
from ..frontend.speakers import SpeakerRegistry
from ..frontend.torch_models import load_frontend_models
from ..frontend.voice_store import COSYVOICE3_FEATURES_FILE, FEATURES_FILE, VoiceStore
from ..llm.prompt import COSYVOICE2, COSYVOICE3, PromptLayout
from ..llm.sampling import COSYVOICE3_SAMPLING, REFERENCE_SAMPLING, SamplingParams
from .front_end import DEFAULT_SPEAKER, SegmentPrompter, TokenLimits, TTSRequest, Voice, VoiceResolver
from ..runtime import COSYVOICE2_DIR, COSYVOICE3_DIR, COSYVOICE3_LLM_DIR, LLM_DIR, SPK2INFO, STEP_AUDIO2_DIR
from ..token2wav.step_audio2 import STEP_AUDIO2_TOKENIZER_ONNX
from ..token2wav.cosyvoice2 import Token2WavOptions, default_flow_dtype, load_token2wav
from ..token2wav.vocoder_stream import SineNoiseProvider
from .core import EngineCore
from .kinds.cosyvoice2 import CosyVoice2Kind
from .kinds.cosyvoice3 import load_cosyvoice3_kind
from .kinds.step_audio2 import load_step_audio2_kind
from .request import EngineRequest
from .runners.llm import BackendLLM, FreeRunningLLM
from .scheduler import Scheduler
from .wire import EngineStats

log = logging.getLogger(__name__)

WARM_UP_TEXT = "你好，欢迎使用语音合成服务。"


class TTSEngine:
    """``core``: an :class:`~.core.EngineCore` or an :class:`~.client.EngineClient` (one interface:
    ``submit``, ``cancel``, ``prepare_voices``, ``voices_arriving``, ``stats``, ``sample_rate``,
    ``close``)."""

    def __init__(self, core, prompter: SegmentPrompter, voices: VoiceResolver, warm_voice: Voice) -> None:
        self.core = core
        self.prompter = prompter
        self.voices = voices
        self.warm_voice = warm_voice  # voices the warm-up (the default speaker, or a synthetic clip)
        voices.featurizer.on_features = core.voices_arriving  # a new clip's voice prepared as soon as it is known
        self.load_phases: dict[str, float] = {}  # load_engine's phases, seconds each

    @property
    def sample_rate(self) -> int:
        return self.core.sample_rate

    def stats(self) -> EngineStats:
        return self.core.stats()

    def submit(self, request: TTSRequest, *, streaming: bool, emit: Callable[[np.ndarray], None],
               finish: Callable[[BaseException | None], None], timeout_s: float = 0.0,
               trace: dict[str, float] | None = None) -> None:
        """Queue ``request``; its prompts are built here (bad text raises here, as does a refusal:
        CapacityError). ``emit``/``finish`` are then called from the engine's loop thread (or the
        client's receiver). ``trace``: the request's first-chunk stamps so far (``arrival``), which the
        engine completes (:data:`~.request.FIRST_CHUNK_STAGES`)."""
        segments = list(self.prompter.segment_prompts(request))
        engine_request = EngineRequest(request.request_id, iter(segments), request.voice, request.limits, streaming,
                                       emit, finish, timeout_s, trace=trace if trace is not None else {})
        engine_request.stamp("submitted")
        self.core.submit(engine_request)

    def cancel(self, request_id: str) -> None:
        self.core.cancel(request_id)

    def prepare_voice(self, voice: Voice, done: Callable[[], None] | None = None) -> None:
        """Have the engine compute and keep ``voice``'s state now (a voice just uploaded), not on its
        first request; not waited for: ``done`` is called once the engine has computed it (a kind
        that prepares voices beside its loop) or launched it on the loop, so that a request sent
        then finds neither its voice's work nor the loop busy. A cross-lingual voice's LLM prompt
        holds nothing of it, but token2wav's state is the same."""
        self.core.prepare_voices([voice.features], done)

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
        voice = self.warm_voice
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


@dataclass(frozen=True)
class ModelKind:
    """What a model kind brings besides its token2wav kind: its LLM prompt layout and sampling, its
    front-end files and prompt-mel band, its registered voices (spk2info.pt) and the file a stored
    voice's features are kept in (a voice uploaded through the API serves every model)."""

    layout: PromptLayout
    sampling: SamplingParams
    speech_tokenizer: str
    mel_fmax: float | None
    registered_voices: bool
    features_file: str
    load_kind: Callable[..., object]  # (model_dir, device, options: dict, sine_noise) -> the kind


def _cosyvoice2_kind(model_dir: Path, device: torch.device, options: dict, sine_noise):
    options = dict(options)
    flow_dtype = options.pop("flow_dtype", None) or default_flow_dtype(device)
    token2wav_options = Token2WavOptions(**{"incremental_stream": True, **options})
    return CosyVoice2Kind(load_token2wav(model_dir, device, flow_dtype, token2wav_options), sine_noise)


def _cosyvoice3_kind(model_dir: Path, device: torch.device, options: dict, sine_noise):
    return load_cosyvoice3_kind(model_dir, device, **options)


def _step_audio2_kind(model_dir: Path, device: torch.device, options: dict, sine_noise):
    return load_step_audio2_kind(model_dir, device, sine_noise=sine_noise, **options)


# Step-Audio2 (NVIDIA's cosyvoice2_dit): CosyVoice2's LLM, prompt layout, sampling and voices (its
# spk2info.pt: load_engine's ``spk2info``) with Step-Audio-2-mini's token2wav directory, whose
# front-end files are CosyVoice2's (the tokenizer under another name): one set of prompt features
# serves the LLM prompt and the flow, and a stored voice's features are CosyVoice2's.
MODEL_KINDS: dict[str, ModelKind] = {
    "cosyvoice2": ModelKind(COSYVOICE2, REFERENCE_SAMPLING, "speech_tokenizer_v2.onnx", COSYVOICE2_MEL_FMAX, True,
                            FEATURES_FILE, _cosyvoice2_kind),
    "cosyvoice3": ModelKind(COSYVOICE3, COSYVOICE3_SAMPLING, "speech_tokenizer_v3.onnx", COSYVOICE3_MEL_FMAX, False,
                            COSYVOICE3_FEATURES_FILE, _cosyvoice3_kind),
    "step_audio2": ModelKind(COSYVOICE2, REFERENCE_SAMPLING, STEP_AUDIO2_TOKENIZER_ONNX, COSYVOICE2_MEL_FMAX, True,
                             FEATURES_FILE, _step_audio2_kind),
}


# Per model kind, under a bundle root (:func:`cosyserve.bundle.make_bundle`'s layout): load_engine's
# ``model_dir`` (token2wav and front-end files), ``llm_dir`` and ``spk2info`` (None: model_dir's own).
BUNDLE_DIRS: dict[str, tuple[str, str, str | None]] = {
    "cosyvoice2": (COSYVOICE2_DIR, LLM_DIR, None),
    "cosyvoice3": (COSYVOICE3_DIR, COSYVOICE3_LLM_DIR, None),
    "step_audio2": (STEP_AUDIO2_DIR, LLM_DIR, f"{COSYVOICE2_DIR}/{SPK2INFO}"),
}


def load_engine(model: str, model_dir: str | Path, llm_dir: str | Path, device: torch.device, *,
                kind_options: dict | None = None, llm_backend=None, llm_options: dict | None = None,
                strategy: str = "exponential", scheduler: Scheduler | None = None,
                voices_dir: Path | None = None, max_text_chars: int | None = None,
                sine_noise: SineNoiseProvider | None = None, sync_stages: bool = False, warm_up: bool = False,
                frontend_backend: str | None = None, spk2info: str | Path | None = None) -> TTSEngine:
    """The stack of ``model`` (a key of :data:`MODEL_KINDS`) on ``device``, its loop running.
    ``kind_options``: the token2wav kind's keyword options (CosyVoice2: ``flow_dtype`` and
    :class:`~cosyserve.token2wav.cosyvoice2.Token2WavOptions`' fields; CosyVoice3:
    :func:`~.kinds.cosyvoice3.load_cosyvoice3_kind`'s; Step-Audio2:
    :func:`~.kinds.step_audio2.load_step_audio2_kind`'s). ``spk2info``: the registered voices of a
    kind that has them (None: ``model_dir``'s spk2info.pt; Step-Audio2's are CosyVoice2's).
    ``llm_backend``: None for our LLM engine, free-running beside the loop (``llm_options``:
    :class:`~cosyserve.llm.engine.llm_engine.LLMEngine`'s), or a :mod:`cosyserve.llm` back end that
    generates on its own threads (an OpenAI-compatible server, tokens forwarded by a front door).
    ``frontend_backend``: the speech tokenizer's and speaker encoder's
    (:func:`~cosyserve.frontend.torch_models.load_frontend_models`; None: PyTorch on a GPU,
    onnxruntime on the CPU). ``warm_up``: capture and compile every shape class of the flow, then
    voice a few requests through the whole loop, before returning (a GPU server's ready state: its
    first request is then as fast as the hundredth)."""
    from ..llm.engine.llm_engine import LLMEngine, Pacing

    if model not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {model!r}; choose one of {sorted(MODEL_KINDS)}")
    spec = MODEL_KINDS[model]
    phases: dict[str, float] = {}
    with _timed(phases, "front end"):
        prompter, voices, warm_voice = load_frontend(model, model_dir, llm_dir, device, voices_dir=voices_dir,
                                                     max_text_chars=max_text_chars,
                                                     frontend_backend=frontend_backend, spk2info=spk2info)
    # the LLM first: the flow's state is sized from the memory it leaves
    with _timed(phases, "llm"):
        if llm_backend is None:
            llm = FreeRunningLLM(LLMEngine(llm_dir, device, **{"pacing": Pacing(), **(llm_options or {})}),
                                 spec.sampling)
        else:
            llm = BackendLLM(llm_backend, spec.sampling)
        llm.register_voices(prompter.text_tokenizer, voices.registry)
    with _timed(phases, "token2wav"):
        kind = spec.load_kind(Path(model_dir), device, kind_options or {}, sine_noise)
        kind.prepare_voices([voice.features for voice in _kept_voices(voices, kind.max_voices)])
    core = EngineCore(kind, llm, strategy=strategy, scheduler=scheduler, sync_stages=sync_stages)
    with _timed(phases, "token2wav warm-up"):  # on the loop's thread (EngineCore.start)
        core.start(warm_up=(lambda: kind.warm_up(warm_voice.features)) if warm_up else None)
    with _timed(phases, "engine warm-up"):
        engine = TTSEngine(core, prompter, voices, warm_voice)
        if warm_up:
            engine.warm_up()
    engine.load_phases = phases
    log.info("%s loaded on %s: %s", model, device, ", ".join(f"{name} {s:.1f} s" for name, s in phases.items()))
    return engine


@contextmanager
def _timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Seconds the block took, as ``phases[name]`` (the load's phases: where a slow start goes)."""
    began = time.perf_counter()
    yield
    phases[name] = time.perf_counter() - began


def load_frontend(model: str, model_dir: str | Path, llm_dir: str | Path, device: torch.device, *,
                  voices_dir: Path | None = None, max_text_chars: int | None = None,
                  frontend_backend: str | None = None,
                  spk2info: str | Path | None = None) -> tuple[SegmentPrompter, VoiceResolver, Voice]:
    """The front-end half of ``model``'s stack: its prompter (text front-end and prompt ids), its voice
    resolver (registered voices, stored ones, new clips through the speech tokenizer and speaker
    encoder on ``device``) and the voice its warm-up speaks with."""
    from transformers import AutoTokenizer

    if model not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {model!r}; choose one of {sorted(MODEL_KINDS)}")
    spec = MODEL_KINDS[model]
    model_dir, llm_dir = Path(model_dir), Path(llm_dir)
    text_tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    registry = (SpeakerRegistry.load(spk2info or model_dir / SPK2INFO) if spec.registered_voices
                else SpeakerRegistry())
    store = VoiceStore(voices_dir, features_file=spec.features_file) if voices_dir is not None else None
    tokenizer, speaker_encoder = load_frontend_models(model_dir / spec.speech_tokenizer, model_dir / "campplus.onnx",
                                                      device, frontend_backend)
    voices = VoiceResolver(registry, tokenizer, speaker_encoder, store=store, mel_fmax=spec.mel_fmax,
                           default_speaker=DEFAULT_SPEAKER if spec.registered_voices else None)
    voices.featurizer.warm_up()  # a new clip's graphs, captured now (on CUDA), not on the first clip of a shape
    prompter = SegmentPrompter(text_tokenizer, layout=spec.layout,
                               **({} if max_text_chars is None else {"max_text_chars": max_text_chars}))
    warm_voice = voices.resolve() if spec.registered_voices else voices.resolve(warm_up_clip(), WARM_UP_TEXT)
    return prompter, voices, warm_voice


def _kept_voices(voices: VoiceResolver, limit: int) -> list[Voice]:
    """The voices whose token2wav prompt state is computed at load: registered ones, then voices
    uploaded through the API, up to ``limit``."""
    kept = [voices.resolve(speaker_id=speaker_id) for speaker_id in voices.registry.ids()[:limit]]
    if voices.store is not None:
        for stored in voices.store.list()[:max(0, limit - len(kept))]:
            kept.append(voices.resolve(speaker_id=stored.id))
    return kept


def warm_up_clip(seconds: float = 3.0) -> np.ndarray:
    """A 16 kHz clip (a gliding tone) that voices the warm-up of a model without registered voices:
    its values do not matter, its shapes are a typical prompt's."""
    t = np.arange(int(seconds * TOKENIZER_SAMPLE_RATE), dtype=np.float64) / TOKENIZER_SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * (150.0 + 40.0 * t) * t)).astype(np.float32)
