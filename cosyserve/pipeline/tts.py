"""One text-to-speech request end to end: prompt ids -> LLM speech tokens -> token2wav audio.

The orchestration here is backend-agnostic. It talks to two small interfaces,
:class:`SpeechTokenSource` (the LLM) and :class:`Token2Wav` (flow + vocoder), so the same code
runs inside the Triton BLS model (both reached through BLS requests, see
``cosyserve.serving.bls``) and in-process (``cosyserve.pipeline.local``: the package objects
called directly, for ``offline_inference.py`` and the tests).

Streaming: everything happens on the calling thread, which reads the LLM's pieces as they come
and synthesises a chunk as soon as :class:`~cosyserve.pipeline.schedule.ChunkScheduler` allows
(as the reference BLS does). Generation and synthesis still overlap: every back end buffers
tokens on its own side (the engine's thread, the ``llm`` Triton model), so the LLM goes on while
a chunk is voiced. Inside Triton this keeps every ``pb_utils`` call of a BLS stub on its
request thread. Ready chunks are emitted after each piece, so the
chunk sequence for ``n`` tokens is exactly :func:`~cosyserve.pipeline.schedule.plan_chunks`
``(n)`` with the exponential strategy, however fast the LLM is. Whenever a request ends early
(cancelled, error), the LLM request is cancelled (which also releases what it holds) and the
token2wav session closed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from ..audio.io import TOKENIZER_SAMPLE_RATE, prompt_audio_from_array
from ..clip_cache import ClipCache
from ..errors import InvalidInputError, RequestCancelledError
from ..frontend.prompt import PromptFeatures, build_prompt_features
from ..frontend.voice_store import VoiceStore, is_voice_id
from ..llm.prompt import MAX_SPEECH_TOKENS, NUM_SPEECH_TOKENS, build_prompt_ids
from .schedule import ChunkScheduler

MAX_TEXT_CHARS = 1000
DEFAULT_MAX_TOKENS = 750  # the reference BLS's request_output_len
DEFAULT_SPEAKER = "001"  # the cached speaker used when a request names no voice
DEFAULT_FEATURE_CACHE_SIZE = 256  # reference clips whose prompt features are kept (VoiceResolver)


@dataclass(frozen=True)
class Voice:
    """Who speaks: the prompt the LLM continues and the features token2wav is conditioned on.

    ``features`` holds raw speech tokens 0..6560, the prompt mel (2P, 80) and the speaker
    embedding (192,). ``speaker_id`` names a registered voice
    (spk2info.pt) or a stored one (:class:`~cosyserve.frontend.voice_store.VoiceStore`); it lets
    back ends reuse what they cache per voice (LLM prefix, default speaker inside token2wav).
    ``cross_lingual``: the voice has no transcript, so the LLM prompt carries neither prompt text
    nor prompt speech tokens (CosyVoice2's cross-lingual mode); token2wav still uses the features.
    """

    prompt_text: str
    features: PromptFeatures
    speaker_id: str | None = None
    cross_lingual: bool = False


@dataclass(frozen=True)
class TokenLimits:
    """How many speech tokens the LLM may (max) and must (min: end of speech masked) produce."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= MAX_SPEECH_TOKENS:
            raise InvalidInputError(f"max_tokens must be in 1..{MAX_SPEECH_TOKENS}, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidInputError(f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")

    def override(self, max_tokens: int | None, min_tokens: int | None) -> "TokenLimits":
        """Per-request limits: given values replace these defaults; min_tokens is clipped to max_tokens."""
        new_max = self.max_tokens if max_tokens is None else int(max_tokens)
        new_min = self.min_tokens if min_tokens is None else int(min_tokens)
        return TokenLimits(new_max, min(new_min, new_max))


@dataclass(frozen=True)
class TTSRequest:
    request_id: str  # unique among in-flight requests: keys the LLM request and the token2wav session
    target_text: str
    voice: Voice
    limits: TokenLimits = field(default_factory=TokenLimits)
    instruction: str | None = None  # instruct mode: ``{instruction}<|endofprompt|>`` replaces the prompt text


class SpeechTokenSource(Protocol):
    """The LLM: raw speech tokens (0..6560) for a prompt, in pieces as they are generated.

    Registered voices' prefixes (``<|sos|>{prompt_text}``) are registered with the engine at
    start-up; its prefix cache then matches them by token ids, so no key travels per request.
    """

    def generate(self, prompt_ids: list[int], request_id: str, limits: TokenLimits) -> Iterator[Sequence[int]]: ...

    def cancel(self, request_id: str) -> None:
        """Stop the request and release what it holds; harmless once it has ended."""


class Token2Wav(Protocol):
    """Flow + vocoder. Streaming sessions are keyed by request id and end with ``finalize``/``cancel``."""

    def offline(self, request_id: str, tokens: Sequence[int], voice: Voice) -> np.ndarray: ...

    def step(self, request_id: str, tokens: Sequence[int], voice: Voice, token_offset: int,
             finalize: bool) -> np.ndarray: ...

    def cancel(self, request_id: str) -> None: ...


def validate_text(text: str, what: str = "target_text", max_chars: int = MAX_TEXT_CHARS) -> str:
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError(f"{what} is empty; send the text to synthesise (1 to {max_chars} characters)")
    if len(text) > max_chars:
        raise InvalidInputError(
            f"{what} has {len(text)} characters; at most {max_chars} are accepted per request (split longer texts)")
    return text


class VoiceResolver:
    """A request's voice inputs -> :class:`Voice`: a reference clip with its transcript, a
    registered speaker id, a voice id of ``store`` (voices uploaded through the HTTP API), or
    neither (the default speaker, "001" of spk2info.pt).

    ``tokenizer``/``speaker_encoder`` only need ``tokenize(wav16)`` / ``embed(wav16)``, so the
    ONNX wrappers (in-process) and BLS calls to the Triton front-end models both fit.

    Voice agents send the same reference clip with every request: the prompt features of the
    last ``feature_cache_size`` distinct clips are kept, keyed by a hash of the validated
    16 kHz samples (the features depend on nothing else), so a repeated clip skips the speech
    tokenizer and the speaker encoder. 0 disables the cache. A stored voice's features are
    computed by the first process that needs them and saved with the voice for all the others.
    """

    def __init__(self, registry: Any, tokenizer: Any, speaker_encoder: Any, *,
                 default_speaker: str = DEFAULT_SPEAKER, max_text_chars: int = MAX_TEXT_CHARS,
                 feature_cache_size: int = DEFAULT_FEATURE_CACHE_SIZE, store: VoiceStore | None = None):
        self.registry = registry
        self.store = store
        self.tokenizer = tokenizer
        self.speaker_encoder = speaker_encoder
        self.default_speaker = default_speaker
        self.max_text_chars = max_text_chars
        self._features: ClipCache[PromptFeatures] = ClipCache(feature_cache_size)
        registry.get(default_speaker)  # a missing default speaker is a start-up error

    def resolve(self, reference_wav16: Any = None, reference_text: str | None = None,
                speaker_id: str | None = None) -> Voice:
        if reference_wav16 is not None:
            if speaker_id:
                raise InvalidInputError("send either reference_wav (+ reference_text) or speaker_id, not both")
            if not reference_text or not reference_text.strip():
                raise InvalidInputError(
                    "reference_wav needs reference_text, the transcript of the reference audio")
            validate_text(reference_text, "reference_text", self.max_text_chars)
            audio = prompt_audio_from_array(reference_wav16, TOKENIZER_SAMPLE_RATE)
            return Voice(reference_text, self._prompt_features(audio))
        if reference_text:
            raise InvalidInputError("reference_text was given without reference_wav; send both or neither")
        if speaker_id and speaker_id not in self.registry and self.store is not None and is_voice_id(speaker_id):
            return self._stored_voice(speaker_id)
        speaker = self.registry.get(speaker_id or self.default_speaker)
        return Voice(speaker.prompt_text, speaker.features, speaker.speaker_id)

    def _stored_voice(self, voice_id: str) -> Voice:
        stored = self.store.get(voice_id)
        features = self.store.load_features(voice_id)
        if features is None:
            audio = prompt_audio_from_array(self.store.audio16(voice_id), TOKENIZER_SAMPLE_RATE)
            features = build_prompt_features(audio, self.tokenizer, self.speaker_encoder)
            self.store.save_features(voice_id, features)
        return Voice(stored.transcript or "", features, voice_id, cross_lingual=stored.transcript is None)

    @property
    def cached_clips(self) -> int:
        return len(self._features)

    def _prompt_features(self, audio) -> PromptFeatures:
        return self._features.get_or_compute(
            audio.wav16, lambda: build_prompt_features(audio, self.tokenizer, self.speaker_encoder))


def never_cancelled() -> bool:
    return False


class TTSPipeline:
    """Text + voice -> 24 kHz waveform, offline (:meth:`synthesize`) or chunk by chunk (:meth:`stream`).

    ``text_tokenizer`` is the LLM's HuggingFace tokenizer (prompt ids, llm_layout.md §3).
    """

    def __init__(self, text_tokenizer: Any, llm: SpeechTokenSource, token2wav: Token2Wav, *,
                 strategy: str = "exponential", max_text_chars: int = MAX_TEXT_CHARS):
        ChunkScheduler(strategy)  # fail at start-up, not per request, on an unknown strategy
        self.text_tokenizer = text_tokenizer
        self.llm = llm
        self.token2wav = token2wav
        self.strategy = strategy
        self.max_text_chars = max_text_chars

    def prompt_ids(self, target_text: str, voice: Voice, instruction: str | None = None) -> list[int]:
        """``<|sos|>{prompt_text}{target_text}<|task_id|>`` + the voice's speech tokens as LLM ids;
        with ``instruction`` ``<|sos|>{instruction}<|endofprompt|>{target_text}<|task_id|>``, for a
        cross-lingual voice ``<|sos|>{target_text}<|task_id|>`` (llm/prompt.py)."""
        validate_text(target_text, "target_text", self.max_text_chars)
        if instruction is not None:
            validate_text(instruction, "instruction", self.max_text_chars)
            return build_prompt_ids(self.text_tokenizer, target_text, instruction=instruction)
        if voice.cross_lingual:
            return build_prompt_ids(self.text_tokenizer, target_text)
        tokens = voice.features.speech_tokens
        return build_prompt_ids(self.text_tokenizer, target_text, voice.prompt_text,
                                [int(t) for t in tokens.reshape(-1).tolist()])

    def _start(self, request: TTSRequest) -> Iterator[Sequence[int]]:
        ids = self.prompt_ids(request.target_text, request.voice, request.instruction)
        return self.llm.generate(ids, request.request_id, request.limits)

    def synthesize(self, request: TTSRequest, is_cancelled: Callable[[], bool] = never_cancelled) -> np.ndarray:
        """The whole waveform (float32, 24 kHz) in one piece."""
        pieces = self._start(request)
        tokens: list[int] = []
        finished = False
        try:
            for piece in pieces:
                tokens.extend(int(t) for t in piece)
                _raise_if_cancelled(is_cancelled, request.request_id)
            finished = True
        finally:
            if not finished:
                self.llm.cancel(request.request_id)
        _check_tokens(tokens, final=True)
        _raise_if_cancelled(is_cancelled, request.request_id)
        return self.token2wav.offline(request.request_id, tokens, request.voice)

    def stream(self, request: TTSRequest, is_cancelled: Callable[[], bool] = never_cancelled) -> Iterator[np.ndarray]:
        """Waveform chunks in order; their concatenation is the utterance.

        Closing the generator early (or an error, or ``is_cancelled()`` turning true) cancels the
        LLM request and closes the token2wav session.
        """
        pieces = self._start(request)
        scheduler = ChunkScheduler(self.strategy)
        rid, voice = request.request_id, request.voice
        tokens: list[int] = []
        llm_done = session_open = finished = False
        try:
            for piece in pieces:
                tokens.extend(int(t) for t in piece)
                _raise_if_cancelled(is_cancelled, rid)
                while (chunk := scheduler.next_chunk(len(tokens))) is not None:
                    part = tokens[:chunk.num_tokens]
                    _check_tokens(part)
                    session_open = True
                    yield self.token2wav.step(rid, part, voice, chunk.token_offset, False)
                    _raise_if_cancelled(is_cancelled, rid)
            llm_done = True
            _check_tokens(tokens, final=True)
            final = scheduler.final_chunk(len(tokens))
            yield self.token2wav.step(rid, tokens, voice, final.token_offset, True)
            finished = True
        finally:
            if not finished:
                if not llm_done:
                    self.llm.cancel(rid)
                if session_open:
                    self.token2wav.cancel(rid)


def _raise_if_cancelled(is_cancelled: Callable[[], bool], request_id: str) -> None:
    if is_cancelled():
        raise RequestCancelledError(f"request {request_id} was cancelled")


def _check_tokens(tokens: Sequence[int], final: bool = False) -> None:
    """The LLM must hand on raw speech tokens only, and at least one by the end."""
    if final and not tokens:
        # Also what a BLS caller sees when the LLM model failed: Triton 24.10 drops error
        # responses of decoupled models on their way to BLS callers.
        raise RuntimeError("the LLM produced no speech tokens for this request (nothing to synthesise)")
    if tokens and not (0 <= min(tokens) and max(tokens) < NUM_SPEECH_TOKENS):
        raise RuntimeError(
            f"the LLM produced token ids outside 0..{NUM_SPEECH_TOKENS - 1}: {min(tokens)}..{max(tokens)}")
