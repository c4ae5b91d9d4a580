"""CosyVoice2's token2wav as a kind of the engine: the UNet flow (incremental windows and
full passes, a batch's chunks packed into one call per Euler step) and HiFT with overlapping
streaming chunks.

What the engine asks of a kind (CosyVoice3's, :mod:`.cosyvoice3`, answers the same): a chunk
schedule, the voices it keeps and gauges of its state, flow jobs for a stream's chunks and for
offline requests, all Euler steps of a batch of them (:meth:`CosyVoice2Kind.solve`), the mel of
a solved job, and batched vocoding. Everything else (requests, LLM, scheduling,
admission) is the engine's and the same for every kind.

Chunks of a stream run through the :class:`~cosyserve.token2wav.flow_engine.FlowEngine`: each
computes only its window against the stream's paged context (the voice's prompt blocks shared).
The final chunk is, by default, the reference's (``final="reference"``): a non-streaming pass
over prompt + all tokens (:class:`~cosyserve.token2wav.full_pass.FullPass`), the stream's pages
freed when it starts; ``final="streaming"`` voices it as one more window. A stream for which the
page pool has no room re-runs every chunk as a streaming full pass (the reference's own
computation, no state kept) instead of failing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CapacityError
from ...lru import LruCache
from ...frontend.prompt import PromptFeatures
from ...schedule import ChunkScheduler
from ...token2wav.cosyvoice2 import CosyVoice2Token2Wav
from ...token2wav.flow_engine import EngineStream
from ...token2wav.full_pass import FullPass, FullPassJob, PassInput
from ...token2wav.vocoder_batch import source_noise, vocode_batch
from ...token2wav.vocoder_stream import HiftStream, SineNoiseProvider, VocoderCall

log = logging.getLogger(__name__)


@dataclass(eq=False)
class FlowJob:
    """One chunk's (or offline request's) flow work: an engine window or a full pass."""

    finalize: bool
    window: Any = None  # flow_engine._Window
    full: FullPassJob | None = None

    @property
    def done(self) -> bool:
        return (self.window or self.full).done

    @property
    def frames(self) -> int:
        """Estimator frames it adds to a batch."""
        return self.window.width if self.window is not None else self.full.frames


@dataclass(eq=False)
class Voicing:
    """A stream's token2wav state: its flow stream (None: re-run mode) and its vocoder."""

    features: PromptFeatures
    prompt: Any  # CosyVoice2Token2Wav's validated prompt
    flow: EngineStream | None
    vocoder: HiftStream

    def close(self) -> None:
        if self.flow is not None:
            self.flow.close()
        self.vocoder.close()


class CosyVoice2Kind:
    """Over a loaded :class:`CosyVoice2Token2Wav` with the incremental engine
    (``Token2WavOptions(incremental_stream=True)``). ``sine_noise``: HiFT's harmonic noise for
    every call (tests: zero noise), else drawn per call."""

    name = "cosyvoice2"
    cold_start = False  # a new voice's prefix is computed as its request arrives
    prepares_beside = True  # on the flow engine's prefix stream, from the core's preparation thread

    def __init__(self, model: CosyVoice2Token2Wav, sine_noise: SineNoiseProvider | None = None) -> None:
        if model.engine is None:
            raise ValueError("the engine's CosyVoice2 kind needs the incremental flow engine (incremental_stream)")
        self.model = model
        self.flow_engine = model.engine
        self.full = FullPass(model.flow, self.flow_engine.fused, self.flow_engine.n_timesteps,
                             self.flow_engine.graphs)
        self.final = model.options.final
        self.final_full_pass = self.final == "reference"
        self.sample_rate = model.sample_rate
        self.sine_noise = sine_noise
        self.fallbacks = 0  # streams that re-ran their chunks because the page pool was full
        # validated prompts on the device, by voice: a stream of a known voice copies nothing to
        # the device and reads nothing back (a blocking copy waits for every kernel queued before it)
        self._prompts: LruCache[str, Any] = LruCache(max(self.flow_engine.max_voices, 1))

    def chunk_schedule(self, strategy: str) -> ChunkScheduler:
        return ChunkScheduler(strategy)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def max_voices(self) -> int:
        """Voices whose prompt state is kept."""
        return self.flow_engine.max_voices

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The kind's state as gauges (``cosyserve_token2wav_<name>``): name -> (help, value)."""
        flow = self.flow_engine
        return {"open_streams": ("streams holding flow state in the engine", flow.open_streams),
                "state_pages": ("pages of the flow engine's state pool", flow.pool.pages),
                "state_pages_in_use": ("state pages held by streams and cached voices",
                                       flow.pool.pages - flow.pool.free_pages),
                "state_voice_pages": ("state pages holding cached voices' prompt state", flow.voice_pages),
                "voices_cached": ("voices whose prompt state is kept", flow.cached_voices),
                "fallback_streams": ("streams that left the flow engine for the full re-run (no state kept) "
                                     "because the page pool was full, at their start or mid-stream, since load",
                                     self.fallbacks)}

    # ----- streams -----

    def _prompt(self, features: PromptFeatures) -> tuple[str, Any]:
        """The voice's key and validated prompt (CosyVoice2Token2Wav's, on the device)."""
        key = features.key()
        prompt = self._prompts.get(key)
        if prompt is None:
            prompt = self.model._prompt(features.speech_tokens, features.speech_feat, features.embedding)
            self._prompts.put(key, prompt)
        return key, prompt

    def cold_frames(self, features: PromptFeatures) -> int:
        return 0  # a stream starts after its voice's prompt state (prepared, or computed by open)

    def open(self, features: PromptFeatures) -> Voicing:
        """A stream's token2wav state, after its voice's kept prompt state (prepared as its request
        arrived; computed now if it was not)."""
        key, prompt = self._prompt(features)
        try:
            flow = self.flow_engine.open(prompt.tokens, prompt.feat, prompt.embedding, key=key)
        except CapacityError:
            flow = None
            self.fallbacks += 1
        return Voicing(features, prompt, flow, HiftStream(self.model.hift, sine_noise=self.sine_noise))

    def keeps(self, features: PromptFeatures) -> bool:
        return self.flow_engine.keeps(features.key())

    def launching(self, features: PromptFeatures) -> bool:
        """The preparation thread is computing this voice's prefix and has not kept it yet (its last
        solve not planned: :meth:`~cosyserve.token2wav.flow_engine.FlowEngine.launching`)."""
        return self.flow_engine.launching(features.key())

    def solvable(self, job: FlowJob) -> bool:
        """False for a first window whose voice's prompt solve has too many steps left to launch
        (:meth:`~cosyserve.token2wav.flow_engine.FlowEngine.solvable`)."""
        return job.window is None or self.flow_engine.solvable(job.window)

    def wait_prepared(self, voices: list[PromptFeatures]) -> None:
        """Until the device has computed these voices' prefixes (their prefix stream's event)."""
        for features in voices:
            self.flow_engine.wait_prepared(features.key())

    def prepare_voices(self, voices: list[PromptFeatures]) -> None:
        """Compute and keep these voices' prompt state (launched on the flow engine's prefix stream;
        the new ones' prompts packed together). Any thread, beside the loop."""
        prompts = [self._prompt(features) for features in voices]
        self.flow_engine.prepare([(p.tokens, p.feat, p.embedding, key) for key, p in prompts])

    def warm_up(self, features: PromptFeatures) -> None:
        """Capture the window steps', new voices' first prompt pieces' and full passes' CUDA graphs (on a
        GPU) and compile the eager passes' kernels (at load)."""
        if self.flow_engine.graphs is not None:
            for name, (count, seconds) in self.flow_engine.capture_graphs().items():
                log.info("cosyvoice2: %d CUDA graphs of the flow engine's %s captured in %.1f s", count, name, seconds)
            self.full.capture_all()
        _, p = self._prompt(features)
        self.full.warm_up(p.tokens, p.feat, p.embedding)

    # ----- flow jobs -----

    def start_chunks(self, chunks: list[tuple[Voicing, list[int], int, bool]]) -> list[FlowJob]:
        """Flow jobs of streams' chunks: (voicing, tokens so far, tokens already voiced, finalize).

        A stream whose chunk finds no free state pages (the pool is full: many long replies at once)
        leaves the flow engine and re-runs this and its later chunks (the reference's computation, no
        state kept); the others go on. Failing them instead would end every request of the batch."""
        jobs: list[FlowJob | None] = [None] * len(chunks)
        windows, passes = [], {True: [], False: []}  # full passes by attention kind (streaming or not)
        for i, (voicing, tokens, offset, finalize) in enumerate(chunks):
            if voicing.flow is not None and (not finalize or self.final == "streaming"):
                windows.append(i)
                continue
            if voicing.flow is not None:  # the reference's final pass: the stream's pages are not needed
                voicing.flow.close()
                voicing.flow = None
            passes[not finalize].append(i)
        window_chunks = {i: self._window_chunk(chunks[i]) for i in windows}
        fits = dict(zip(windows, self.flow_engine.fit(list(window_chunks.values()))))
        self._leave_engine(chunks, [i for i in windows if not fits[i]], passes)
        windows = [i for i in windows if fits[i]]
        self._start_passes(chunks, passes, jobs)  # before the windows: a failed pass leaves no stream changed
        if windows:
            try:
                opened = self.flow_engine.start([window_chunks[i] for i in windows])
            except CapacityError:  # pages taken since fit (a new voice's prompt): these chunks re-run
                self._start_passes(chunks, self._leave_engine(chunks, windows, {True: [], False: []}), jobs)
                return jobs
            for i, window in zip(windows, opened):
                jobs[i] = FlowJob(chunks[i][3], window=window)
        return jobs

    def _start_passes(self, chunks: list[tuple[Voicing, list[int], int, bool]], passes: dict[bool, list[int]],
                      jobs: list[FlowJob | None]) -> None:
        """The full passes of the chunks ``passes`` lists (by attention kind: streaming or not), into ``jobs``."""
        for streaming, members in passes.items():
            if members:
                started = self.full.start([self._pass_input(chunks[i][0].prompt, chunks[i][1], 2 * chunks[i][2])
                                           for i in members], streaming)
                for i, full in zip(members, started):
                    jobs[i] = FlowJob(chunks[i][3], full=full)

    @staticmethod
    def _window_chunk(chunk: tuple[Voicing, list[int], int, bool]) -> tuple[EngineStream, torch.Tensor, bool]:
        voicing, tokens, _, finalize = chunk
        return voicing.flow, _tensor(tokens), finalize

    def _leave_engine(self, chunks: list[tuple[Voicing, list[int], int, bool]], members: list[int],
                      passes: dict[bool, list[int]]) -> dict[bool, list[int]]:
        """These chunks' streams re-run their chunks from now on (their pages go back to the pool):
        added to ``passes``, which is returned."""
        for i in members:
            voicing, _, _, finalize = chunks[i]
            voicing.flow.close()
            voicing.flow = None
            self.fallbacks += 1
            passes[not finalize].append(i)
        return passes

    def start_offline(self, features: PromptFeatures, tokens: list[int]) -> FlowJob:
        _, prompt = self._prompt(features)
        (full,) = self.full.start([self._pass_input(prompt, tokens)])
        return FlowJob(True, full=full)

    @staticmethod
    def _pass_input(prompt, tokens: list[int], skip_frames: int = 0) -> PassInput:
        return PassInput(_tensor(tokens), prompt.tokens, prompt.feat, prompt.embedding, skip_frames)

    def solve(self, jobs: list[FlowJob]) -> None:
        """Every Euler step of every job (started together), launched: the windows packed into one
        call per step, the full passes into one per step and attention kind."""
        windows = [job.window for job in jobs if job.window is not None]
        if windows:
            self.flow_engine.solve(windows)
        for streaming in (True, False):
            passes = [job.full for job in jobs if job.full is not None and job.full.streaming == streaming]
            if passes:
                self.full.solve(passes)

    def mel(self, job: FlowJob) -> torch.Tensor:
        """A done job's new target mel (1, 80, f) float32."""
        return self.flow_engine.finish(job.window) if job.window is not None else job.full.target_mel()

    def abort(self, jobs: list[FlowJob]) -> None:
        """Release what unfinished jobs hold (a failed step)."""
        self.flow_engine.abort([job.window for job in jobs if job.window is not None])

    # ----- vocoder -----

    def vocode(self, items: list[tuple[Voicing | None, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """PCM (1-D float32, on the device, launched) of each (stream's voicing, or None for an
        offline request; mel; final chunk), HiFT batched by shape."""
        hift = self.model.hift
        calls = [v.vocoder.prepare(mel, finalize=final) if v is not None else
                 VocoderCall(mel, None, True, hift.hop_length, True) for v, mel, final in items]
        harmonics = hift.m_source.num_harmonics
        noises = [source_noise(call, harmonics, self.model.device, None, self.sine_noise) if call.needed else None
                  for call in calls]
        outputs = vocode_batch(self.model.vocoder, calls, noises)
        pcm = []
        for (voicing, _, _), call, output in zip(items, calls, outputs):
            if voicing is None:
                audio = output[0][0]
            else:
                raw, source = output if output is not None else (None, None)
                audio = voicing.vocoder.complete(call, raw, source).audio[0]
            pcm.append(audio.detach().to(torch.float32))
        return pcm


def _tensor(tokens: list[int]) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)[None]
