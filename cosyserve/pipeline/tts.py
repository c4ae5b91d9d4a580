"""One text-to-speech request end to end: prompt ids -> LLM speech tokens -> token2wav audio.

The orchestration here is backend-agnostic. It talks to two small interfaces,
:class:`SpeechTokenSource` (the LLM) and :class:`Token2Wav` (flow + vocoder), over the package
objects called in-process (``cosyserve.pipeline.local``, ``offline_inference.py`` and the tests).
The Triton models serve every request of a GPU in one loop instead (:mod:`cosyserve.engine`), with
this module's voices, prompts and limits. The token2wav (CosyVoice2's or CosyVoice3's flow) keeps a
session per request id.

Streaming: everything happens on the calling thread, which reads the LLM's pieces as they come
and synthesises a chunk as soon as :class:`~cosyserve.schedule.ChunkScheduler` allows
(as the reference BLS does). Generation and synthesis still overlap: every back end buffers
tokens on its own side (the engine's thread, the ``llm`` Triton model), so the LLM goes on while
a chunk is voiced. Inside Triton this keeps every ``pb_utils`` call of a BLS stub on its
request thread. Ready chunks are emitted after each piece, so the
chunk sequence for ``n`` tokens is exactly :func:`~cosyserve.schedule.plan_chunks`
``(n)`` with the exponential strategy, however fast the LLM is. Whenever a request ends early
(cancelled, error), the LLM request is cancelled (which also releases what it holds) and the
token2wav session closed.

Long text: :class:`~cosyserve.text.TextFrontend` normalises the request text and splits it into
segments (upstream CosyVoice's rules; ``TTSRequest.text_frontend`` false skips both). Each
segment is one LLM request and one token2wav session (ids ``<request id>``, ``<request id>.1``,
...), all with the request's voice. A stream voices them in order, one after the other, as one
stream; the LLM request of the next segment starts as soon as the current one has sent its first
chunk (or its LLM has finished), so it generates while the current segment is voiced and the
first chunk comes as soon as for a one-segment text. Offline, the segments' waveforms are
concatenated.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from ..audio.io import TOKENIZER_SAMPLE_RATE, prompt_audio_from_array
from ..clip_cache import ClipCache
from ..errors import InvalidInputError, RequestCancelledError
from ..frontend.prompt import COSYVOICE2_MEL_FMAX, PromptFeatures, Voice, build_prompt_features
from ..frontend.voice_store import VoiceStore, is_voice_id
from ..llm.prompt import COSYVOICE2, MAX_SPEECH_TOKENS, NUM_SPEECH_TOKENS, PromptLayout, build_prompt_ids
from ..schedule import ChunkScheduler
from ..text import MAX_SEGMENT_CHARS, MAX_TEXT_CHARS, TextFrontend

DEFAULT_MAX_TOKENS = 750  # the reference BLS's request_output_len
DEFAULT_SPEAKER = "001"  # the cached speaker used when a request names no voice
DEFAULT_FEATURE_CACHE_SIZE = 256  # reference clips whose prompt features are kept (VoiceResolver)


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
    limits: TokenLimits = field(default_factory=TokenLimits)  # per segment
    text_frontend: bool = True  # normalise and split target_text (and a reference clip's transcript)
    instruction: str | None = None  # instruct mode: ``{instruction}<|endofprompt|>`` replaces the prompt text


@dataclass(frozen=True)
class SegmentPrompt:
    """One segment of a request: its LLM / token2wav request id, its text and its LLM prompt ids."""

    request_id: str
    text: str
    ids: list[int]


class SpeechTokenSource(Protocol):
    """The LLM: raw speech tokens (0..6560) for a prompt, in pieces as they are generated.

    Registered voices' prefixes (``<|sos|>{prompt_text}``) are registered with the engine at
    start-up; its prefix cache then matches them by token ids, so no key travels per request.
    """

    def generate(self, prompt_ids: list[int], request_id: str, limits: TokenLimits) -> Iterator[Sequence[int]]: ...

    def cancel(self, request_id: str) -> None:
        """Stop the request and release what it holds; harmless once it has ended."""


class Token2Wav(Protocol):
    """Flow + vocoder. Streaming sessions are keyed by request id and end with ``finalize``/``cancel``.

    A ``step`` gets the tokens so far (up to the chunk's look-ahead), of which the first
    ``token_offset`` were voiced by earlier steps; its session opens at ``token_offset`` 0.
    """

    def offline(self, request_id: str, tokens: Sequence[int], voice: Voice) -> np.ndarray: ...

    def step(self, request_id: str, tokens: Sequence[int], voice: Voice, token_offset: int,
             finalize: bool) -> np.ndarray: ...

    def cancel(self, request_id: str) -> None: ...


def validate_text(text: str, what: str = "target_text", max_chars: int = MAX_SEGMENT_CHARS) -> str:
    """A text checked before it is normalised or split (a request's text, a reference transcript)."""
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

    ``default_speaker`` None: the model has no registered voices (CosyVoice3 ships no spk2info.pt),
    so a request must bring its reference clip and transcript; its voice is then the content of both
    (features keyed by the clip, the transcript as sent), never the transcript alone. ``mel_fmax``: the
    model's prompt-mel band edge (:func:`~cosyserve.frontend.prompt.build_prompt_features`).
    """

    def __init__(self, registry: Any, tokenizer: Any, speaker_encoder: Any, *,
                 default_speaker: str | None = DEFAULT_SPEAKER, max_text_chars: int = MAX_SEGMENT_CHARS,
                 feature_cache_size: int = DEFAULT_FEATURE_CACHE_SIZE, store: VoiceStore | None = None,
                 mel_fmax: float | None = COSYVOICE2_MEL_FMAX):
        self.registry = registry
        self.store = store
        self.tokenizer = tokenizer
        self.speaker_encoder = speaker_encoder
        self.default_speaker = default_speaker
        self.max_text_chars = max_text_chars
        self.mel_fmax = mel_fmax
        self._features: ClipCache[PromptFeatures] = ClipCache(feature_cache_size)
        if default_speaker is not None:
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
            return Voice(reference_text, self._prompt_features(audio),
                         reference_wav16=np.asarray(reference_wav16, np.float32))
        if reference_text:
            raise InvalidInputError("reference_text was given without reference_wav; send both or neither")
        if speaker_id and speaker_id not in self.registry and self.store is not None and is_voice_id(speaker_id):
            return self._stored_voice(speaker_id)
        if not speaker_id and self.default_speaker is None:
            raise InvalidInputError("this model has no default speaker: send reference_wav (16 kHz, with "
                                    "reference_wav_len) and reference_text, its transcript")
        speaker = self.registry.get(speaker_id or self.default_speaker)
        return Voice(speaker.prompt_text, speaker.features, speaker.speaker_id)

    def _stored_voice(self, voice_id: str) -> Voice:
        stored = self.store.get(voice_id)
        features = self.store.load_features(voice_id)
        if features is None:
            audio = prompt_audio_from_array(self.store.audio16(voice_id), TOKENIZER_SAMPLE_RATE)
            features = build_prompt_features(audio, self.tokenizer, self.speaker_encoder, self.mel_fmax)
            self.store.save_features(voice_id, features)
        return Voice(stored.transcript or "", features, voice_id, cross_lingual=stored.transcript is None)

    @property
    def cached_clips(self) -> int:
        return len(self._features)

    def _prompt_features(self, audio) -> PromptFeatures:
        return self._features.get_or_compute(
            audio.wav16, lambda: build_prompt_features(audio, self.tokenizer, self.speaker_encoder, self.mel_fmax))


def never_cancelled() -> bool:
    return False


class SegmentPrompter:
    """A request's text -> its segments' LLM prompts: the text front-end (normalisation and
    splitting, :class:`~cosyserve.text.TextFrontend`) and the prompt layout.

    ``text_tokenizer`` is the LLM's HuggingFace tokenizer (prompt ids, llm_layout.md §3; it also
    measures English segments). ``max_text_chars`` bounds a request's whole text. ``layout``: the
    LLM's prompt layout (CosyVoice2's or CosyVoice3's, ``llm/prompt.py``).
    """

    def __init__(self, text_tokenizer: Any, *, max_text_chars: int = MAX_TEXT_CHARS,
                 layout: PromptLayout = COSYVOICE2):
        self.text_tokenizer = text_tokenizer
        self.layout = layout
        self.text = TextFrontend(lambda text: text_tokenizer.encode(text, add_special_tokens=False),
                                 max_text_chars=max_text_chars)

    @property
    def max_text_chars(self) -> int:
        return self.text.max_text_chars

    def prompt_ids(self, segment: str, voice: Voice, prompt_text: str | None = None,
                   instruction: str | None = None) -> list[int]:
        """``<|sos|>{prompt_text}{segment}<|task_id|>`` + the voice's speech tokens as LLM ids
        (``prompt_text``: the voice's, or its normalised form from :meth:`voice_prompt_text`); with
        ``instruction`` ``<|sos|>{instruction}<|endofprompt|>{segment}<|task_id|>``, for a
        cross-lingual voice ``<|sos|>{segment}<|task_id|>`` (llm/prompt.py)."""
        validate_text(segment, "target_text", self.text.max_segment_chars)
        if instruction is not None:
            validate_text(instruction, "instruction", self.text.max_segment_chars)
            return build_prompt_ids(self.text_tokenizer, segment, instruction=instruction, layout=self.layout)
        if voice.cross_lingual:
            return build_prompt_ids(self.text_tokenizer, segment, layout=self.layout)
        tokens = voice.features.speech_tokens
        return build_prompt_ids(self.text_tokenizer, segment, voice.prompt_text if prompt_text is None else prompt_text,
                                [int(t) for t in tokens.reshape(-1).tolist()], layout=self.layout)

    def voice_prompt_text(self, voice: Voice, text_frontend: bool = True) -> str:
        """A reference clip's transcript is normalised as the target text is (upstream does the
        same); a registered voice's is used as registered, which its cached LLM prefix matches."""
        return voice.prompt_text if voice.speaker_id is not None else self.text.normalize(voice.prompt_text,
                                                                                             text_frontend)

    def segment_prompts(self, request: TTSRequest) -> Iterator[SegmentPrompt]:
        """Each segment's prompt, computed lazily; the text is checked at the first ``next``."""
        prompt_text = None
        for k, segment in enumerate(self.text.segments(request.target_text, request.text_frontend)):
            if prompt_text is None:
                prompt_text = self.voice_prompt_text(request.voice, request.text_frontend)
            yield SegmentPrompt(request.request_id if k == 0 else f"{request.request_id}.{k}", segment,
                                self.prompt_ids(segment, request.voice, prompt_text, request.instruction))


class TTSPipeline:
    """Text + voice -> 24 kHz waveform, offline (:meth:`synthesize`) or chunk by chunk (:meth:`stream`),
    one request on the calling thread, over a :class:`SpeechTokenSource` and a :class:`Token2Wav`.
    Arguments as for :class:`SegmentPrompter`, whose methods it offers too.
    """

    def __init__(self, text_tokenizer: Any, llm: SpeechTokenSource, token2wav: Token2Wav, *,
                 strategy: str = "exponential", max_text_chars: int = MAX_TEXT_CHARS,
                 layout: PromptLayout = COSYVOICE2):
        ChunkScheduler(strategy)  # fail at start-up, not per request, on an unknown strategy
        self.llm = llm
        self.token2wav = token2wav
        self.strategy = strategy
        self.prompter = SegmentPrompter(text_tokenizer, max_text_chars=max_text_chars, layout=layout)
        self.text = self.prompter.text
        self.segment_prompts = self.prompter.segment_prompts

    @property
    def max_text_chars(self) -> int:
        return self.prompter.max_text_chars

    def synthesize(self, request: TTSRequest, is_cancelled: Callable[[], bool] = never_cancelled) -> np.ndarray:
        """The whole waveform (float32, 24 kHz) in one piece: the segments' waveforms concatenated.

        The LLM request of segment k+1 runs while token2wav voices segment k."""
        prompts = self.segment_prompts(request)
        generating: dict[str, Iterator[Sequence[int]]] = {}  # started LLM requests not read to their end

        def start_next() -> str | None:
            item = next(prompts, None)
            if item is None:
                return None
            generating[item.request_id] = self.llm.generate(item.ids, item.request_id, request.limits)
            return item.request_id

        waves = []
        finished = False
        try:
            rid = start_next()
            while rid is not None:
                tokens: list[int] = []
                for piece in generating[rid]:
                    tokens.extend(int(t) for t in piece)
                    _raise_if_cancelled(is_cancelled, request.request_id)
                del generating[rid]
                next_rid = start_next()
                _raise_if_cancelled(is_cancelled, request.request_id)
                _check_tokens(tokens, final=True)
                waves.append(self.token2wav.offline(rid, tokens, request.voice))
                rid = next_rid
            finished = True
        finally:
            if not finished:
                for rid in generating:
                    self.llm.cancel(rid)
        if not waves:  # no segment
            return np.zeros(0, np.float32)
        return waves[0] if len(waves) == 1 else np.concatenate(waves)

    def stream(self, request: TTSRequest, is_cancelled: Callable[[], bool] = never_cancelled) -> Iterator[np.ndarray]:
        """Waveform chunks in order, segment after segment; their concatenation is the utterance.

        Closing the generator early (or an error, or ``is_cancelled()`` turning true) cancels the
        LLM requests under way and closes the open token2wav session.
        """
        prompts = self.segment_prompts(request)
        voice = request.voice
        generating: dict[str, Iterator[Sequence[int]]] = {}  # started LLM requests not read to their end
        waiting: deque[str] = deque()  # started segments, in order, not voiced yet (at most one ahead)
        open_session: str | None = None

        def start_next() -> None:
            if len(waiting) > 1:
                return
            item = next(prompts, None)
            if item is not None:
                generating[item.request_id] = self.llm.generate(item.ids, item.request_id, request.limits)
                waiting.append(item.request_id)

        finished = False
        try:
            start_next()
            while waiting:
                rid = waiting[0]
                scheduler = ChunkScheduler(self.strategy)
                tokens: list[int] = []
                for piece in generating[rid]:
                    tokens.extend(int(t) for t in piece)
                    _raise_if_cancelled(is_cancelled, rid)
                    while (chunk := scheduler.next_chunk(len(tokens))) is not None:
                        part = tokens[:chunk.num_tokens]
                        _check_tokens(part)
                        open_session = rid
                        yield self.token2wav.step(rid, part, voice, chunk.token_offset, False)
                        _raise_if_cancelled(is_cancelled, rid)
                        start_next()
                del generating[rid]
                start_next()
                _check_tokens(tokens, final=True)
                final = scheduler.final_chunk(len(tokens))
                yield self.token2wav.step(rid, tokens, voice, final.token_offset, True)
                open_session = None
                waiting.popleft()
            finished = True
        finally:
            if not finished:
                for rid in generating:
                    self.llm.cancel(rid)
                if open_session is not None:
                    self.token2wav.cancel(open_session)


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
