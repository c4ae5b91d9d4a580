"""State of one request inside the engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..prompt import COSYVOICE2, NUM_SPEECH_TOKENS, PromptLayout
from ..sampling import SamplingParams
from ..stream import Finished, TokenStream


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new_tokens: int  # params.max_tokens, cut to what fits in the model length
    stream: TokenStream
    on_token: Callable[[int], None] | None = None
    layout: PromptLayout = COSYVOICE2
    output: list[int] = field(default_factory=list)
    slot: int = -1
    cancelled: bool = False
    finished: bool = False
    started_at: float | None = None  # when it was prefilled (its first token), on the monotonic clock

    @property
    def position(self) -> int:
        """Position of the newest token, the next decode step's input."""
        return len(self.prompt_ids) + len(self.output) - 1

    @property
    def prompt_window_ids(self) -> list[int]:
        """Prompt speech tokens as output-window indices (for the repetition penalty)."""
        start = self.layout.speech_token_offset
        return [t - start for t in self.prompt_ids if start <= t < start + self.layout.output_window_size]

    def append(self, token: int) -> bool:
        """Record a sampled window index; returns True when the request is now finished. Window
        indices from ``NUM_SPEECH_TOKENS`` on are the layout's stop ids (never handed on)."""
        if token >= NUM_SPEECH_TOKENS:
            self.finish(Finished("stop"))
            return True
        self.output.append(token)
        self.stream.put(token)
        if self.on_token is not None:
            try:
                self.on_token(token)
            except Exception as exc:  # a failing callback ends its own request only
                self.finish(Finished("error", exc))
                return True
        if len(self.output) >= self.max_new_tokens:
            self.finish(Finished("length"))
            return True
        return False

    def finish(self, event: Finished) -> None:
        if not self.finished:
            self.finished = True
            self.stream.put(event)
