"""What a text-to-speech request is before the engine runs it: its text, voice and limits
(:class:`TTSRequest`), the voice it names resolved to prompt features (:class:`VoiceResolver`), and
its segments' LLM prompts (:class:`SegmentPrompter`). The engine (:mod:`cosyserve.engine`) runs
every request of a GPU in one loop; the front doors (Triton, offline_inference.py, benchmarks) build
requests here.

Long text: :class:`~cosyserve.text.TextFrontend` normalises the request text and splits it into
segments (upstream CosyVoice's rules; ``TTSRequest.text_frontend`` false skips both). Each
segment is one LLM request (ids ``<request id>``, ``<request id>.1``, ...), all with the request's
voice; the engine voices them in order as one stream (:mod:`cosyserve.engine.request`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from ..audio.io import TOKENIZER_SAMPLE_RATE, prompt_audio_from_array
from ..clip_cache import ClipCache
from ..errors import InvalidInputError
from ..frontend.featurizer import PromptFeaturizer
from ..frontend.prompt import COSYVOICE2_MEL_FMAX, PromptFeatures, Voice
from ..frontend.voice_store import VoiceStore, is_voice_id
from ..llm.prompt import COSYVOICE2, MAX_SPEECH_TOKENS, PromptLayout, build_prompt_ids
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

    A new clip's features come from a :class:`~cosyserve.frontend.featurizer.PromptFeaturizer` over
    ``tokenizer``/``speaker_encoder`` (``start_batch``: the PyTorch or onnxruntime models): clips
    resolved on several threads while the models are busy share their next call.

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
        self.featurizer = PromptFeaturizer(tokenizer, speaker_encoder, mel_fmax)
        self.default_speaker = default_speaker
        self.max_text_chars = max_text_chars
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
            with self.featurizer.arrival() as arrival:  # a batch gathering now waits for this clip
                audio = prompt_audio_from_array(reference_wav16, TOKENIZER_SAMPLE_RATE)
                features = self._features.get_or_compute(audio.wav16, lambda: self.featurizer.features(audio, arrival))
            return Voice(reference_text, features, reference_wav16=np.asarray(reference_wav16, np.float32))
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
            features = self.featurizer.features(audio)
            self.store.save_features(voice_id, features)
        return Voice(stored.transcript or "", features, voice_id, cross_lingual=stored.transcript is None)

    @property
    def cached_clips(self) -> int:
        return len(self._features)


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
