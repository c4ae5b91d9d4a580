"""What the engine core asks of a token2wav kind (CosyVoice2's, CosyVoice3's, Step-Audio2's).

A kind owns its modules, its voices' cached state and its streams' state; the core owns requests,
the LLM, scheduling and admission, the same for every kind. Per loop iteration the core starts a
batch of chunk jobs (:meth:`Kind.start_chunks`, :meth:`Kind.start_offline`), solves them together
(:meth:`Kind.solve`: every Euler step, launched on the device, not waited for), reads their mels
(:meth:`Kind.mel`) and vocodes them in one call (:meth:`Kind.vocode`: PCM on the device; the core
copies it to the host). A job that will not be solved is given back with :meth:`Kind.abort`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ...frontend.prompt import PromptFeatures


class Job(Protocol):
    """A chunk's (or an offline request's) flow work."""

    finalize: bool  # the stream's last chunk (offline: always)

    @property
    def done(self) -> bool:
        """Solved: its mel can be read."""

    @property
    def frames(self) -> int:
        """Estimator frames it adds to a batch (the scheduler's budget)."""


class Voicing(Protocol):
    """A stream's token2wav state (flow and vocoder), opened at its first chunk."""

    def close(self) -> None:
        """Release what the stream holds (idempotent)."""


class ChunkSchedule(Protocol):
    """When a stream's next chunk may start (:mod:`cosyserve.schedule`)."""

    def next_chunk(self, available: int): ...

    def final_chunk(self, available: int): ...


class Kind(Protocol):
    name: str
    sample_rate: int
    final_full_pass: bool  # a stream's final chunk is a pass over everything (batched with passes, not windows)
    # A stream of a voice whose state is not kept starts without it, at no extra pass (its first job
    # computes the prompt too): the core then prepares a request's voice only when it comes again.
    # False: open computes the voice's state, so the core prepares each new voice as its request arrives.
    cold_start: bool
    # prepare_voices may run on a thread of its own while the loop runs chunks (the kind computes voices
    # on a CUDA stream of its own, and a stream's work waits for its voice on the device): the core then
    # prepares a request's voice as it is submitted, beside the loop. False: on the loop, behind its batch.
    prepares_beside: bool

    @property
    def device(self) -> torch.device: ...

    @property
    def max_voices(self) -> int:
        """Voices whose prompt state is kept."""

    def chunk_schedule(self, strategy: str) -> ChunkSchedule:
        """A new stream's chunk schedule (InvalidInputError for an unknown strategy)."""

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The kind's state as gauges ``cosyserve_token2wav_<name>``: name -> (help, value)."""

    def open(self, features: PromptFeatures) -> Voicing:
        """A stream of this voice."""

    def cold_frames(self, features: PromptFeatures) -> int:
        """Estimator frames of this voice's prompt that the first window of a stream opened now
        carries besides its tokens' (the scheduler's budget counts them): the prompt's, when the kind
        would start the stream without the voice's state; 0 when that state is kept or ``open``
        computes it. Host only, never waits."""

    def prepare_voices(self, voices: list[PromptFeatures]) -> None:
        """Compute and keep these voices' state (registered ones at load, uploaded ones at upload; a
        request's voice when it arrives, or, with :attr:`cold_start`, when it comes again), launched,
        not waited for; voices kept already cost nothing. A bad voice raises (its requests then fail
        at ``open``). With :attr:`prepares_beside`, any thread may call it while the loop runs."""

    def warm_up(self, features: PromptFeatures) -> None:
        """Run every stage once, capturing graphs and compiling kernels (at load, on the loop's thread:
        :meth:`~cosyserve.engine.core.EngineCore.start`)."""

    def start_chunks(self, chunks: list[tuple[Voicing, list[int], int, bool]]) -> list[Job]:
        """Jobs of streams' chunks: (voicing, tokens so far, tokens already voiced, finalize); their
        encoders launched. An error fails every chunk of the call (the core then starts them one by one)."""

    def start_offline(self, features: PromptFeatures, tokens: list[int]) -> Job:
        """An offline request's job: every token in one pass."""

    def solve(self, jobs: list[Job]) -> None:
        """Every Euler step of every job (started, none solved), launched."""

    def mel(self, job: Job) -> torch.Tensor:
        """A solved job's new mel (1, 80, frames) float32; a stream's state moves on to after it."""

    def abort(self, jobs: list[Job]) -> None:
        """Release what unsolved jobs hold; their streams cannot go on."""

    def vocode(self, items: list[tuple[Voicing | None, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """PCM (1-D float32 on the device, launched) of each (stream's voicing, or None for an
        offline request; mel; final chunk), in one batched call."""


class PreparesBeside(Kind, Protocol):
    """What the core also asks of a kind with :attr:`~Kind.prepares_beside` (its preparation thread
    calls ``prepare_voices`` while the loop runs)."""

    def keeps(self, features: PromptFeatures) -> bool:
        """This voice's state is kept (prepared, or being launched): a stream of it opens without
        computing it. Host only, never waits."""

    def launching(self, features: PromptFeatures) -> bool:
        """Another thread is launching this voice's state now, so that ``open`` would wait long for it:
        the core plans the voice's streams' first chunks later instead of holding up the others'."""

    def solvable(self, job: Job) -> bool:
        """The job (started) can be solved now without the loop waiting long on the host for its voice's
        launch on the preparation thread: the core keeps a job that cannot (a first chunk started while
        its voice's state is still being launched: its encoder ran beside it) and solves it in a later
        iteration. Host only, never waits."""

    def wait_prepared(self, voices: list[PromptFeatures]) -> None:
        """Block (the GIL released) until the device has computed these voices' state, launched by
        ``prepare_voices``: an upload is answered then, so that its first request finds it done."""
