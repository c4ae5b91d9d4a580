"""The incremental, batched streaming flow of CosyVoice2: many streams' chunks in one packed step.

Under streaming masks the flow is chunk-causal (:mod:`cosyserve.models.flow.stream` explains why):
once a 50-frame estimator block is complete, its state at every Euler step never changes. So a
stream keeps, per Euler step, the keys/values of every attention layer for its complete blocks
and the left input frames of every causal conv; each chunk computes only its *window* (the open
block of the previous chunk plus the new frames) against that cached context.

:class:`FlowEngine` runs the windows of several streams together: the encoder per stream (it is
~1 % of the work), then each of the 10 guided Euler steps as one
:class:`~cosyserve.models.flow.fused.FusedEstimator` step over all streams' rows, every row
attending to its own context.

State lives in a :class:`PagePool`: one page holds one estimator block (50 frames) of K/V for
every step, layer and CFG row (114.7 MB in fp16 for the released model). A stream's context is
its voice's pages followed by its own.

A voice's prompt frames depend only on the voice (prompt tokens, prompt mel, speaker embedding,
the fixed noise): the first ``50 * floor((P - 3) / 25)`` frames of a P-token prompt are complete
blocks before any target token arrives. :class:`VoicePrefix` computes them once per voice,
keyed by content, and every stream of that voice starts from them (pages shared, refcounted),
so a first chunk computes its ~36-80 new frames rather than prompt + new frames.

Every chunk's mel equals the full re-run's (``CosyVoice2Flow.inference`` over prompt + all tokens
so far, streaming masks) up to float rounding; a final chunk through the engine
(``TOKEN2WAV_FINAL=streaming``) equals ``inference(streaming=True, finalize=True)``. The
reference's final chunk, a non-streaming pass over everything, is not incremental and runs
outside the engine.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import CapacityError, InvalidInputError
from ..models.flow import CosyVoice2Flow, fixed_noise
from ..models.flow.cache import FrameBuffer, StreamWindow, copy_states
from ..models.flow.cfm import N_TIMESTEPS
from ..models.flow.fused import FusedEstimator

# Voices whose prefix is kept when nothing else limits them (pages are freed earlier under pressure).
DEFAULT_MAX_VOICES = 64


class PagePool:
    """Fixed pages of per-step estimator state, allocated once (no allocation while serving).

    ``data`` (pages, steps, layers, 2 CFG rows, page_frames, 2 * inner). Pages are refcounted: a
    voice prefix's pages are shared by its streams.
    """

    def __init__(self, pages: int, steps: int, layers: int, page_frames: int, width: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.page_frames = page_frames
        self.data = torch.zeros(pages, steps, layers, 2, page_frames, width, device=device, dtype=dtype)
        self._free = list(range(pages - 1, -1, -1))
        self._refs = np.zeros(pages, dtype=np.int64)
        self._lock = threading.Lock()

    @staticmethod
    def page_bytes(steps: int, layers: int, page_frames: int, width: int, dtype: torch.dtype) -> int:
        return steps * layers * 2 * page_frames * width * torch.empty((), dtype=dtype).element_size()

    @property
    def pages(self) -> int:
        return self.data.size(0)

    @property
    def free_pages(self) -> int:
        with self._lock:
            return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` pages (refcount 1), or None when fewer are free."""
        with self._lock:
            if count > len(self._free):
                return None
            pages = [self._free.pop() for _ in range(count)]
            self._refs[pages] = 1
            return pages

    def share(self, pages: list[int]) -> None:
        with self._lock:
            self._refs[pages] += 1

    def release(self, pages: list[int]) -> None:
        with self._lock:
            for page in pages:
                self._refs[page] -= 1
                if self._refs[page] == 0:
                    self._free.append(page)


@dataclass
class _FlowState:
    """Where an incremental flow stands: encoder state, committed mu, estimator context per step."""

    encoder_states: dict
    mu: FrameBuffer
    conv: torch.Tensor  # (steps, 2 CFG rows, conv width): conv context at frame_commit
    pages: list[int] = field(default_factory=list)  # estimator blocks [0, frame_commit), voice first
    token_commit: int = 0  # tokens (prompt included) in complete encoder blocks
    frame_commit: int = 0  # frames (prompt included) in complete estimator blocks


@dataclass
class VoicePrefix:
    """A voice's flow state after its prompt alone (read-only; streams fork it)."""

    key: str
    prompt_tokens: torch.Tensor  # (1, P) long, on the device
    prompt_feat: torch.Tensor  # (1, 2P, 80)
    spks: torch.Tensor  # (1, 80) projected speaker vector
    state: _FlowState
    streams: int = 0  # open streams forked from it

    @property
    def frames(self) -> int:
        return self.state.frame_commit


class EngineStream:
    """One request's incremental flow: :meth:`FlowEngine.run` steps it; :meth:`close` frees its pages."""

    def __init__(self, engine: FlowEngine, voice: VoicePrefix) -> None:
        self.engine = engine
        self.voice = voice
        prefix = voice.state
        engine.pool.share(prefix.pages)
        self._state = _FlowState(copy_states(prefix.encoder_states), prefix.mu.copy(), prefix.conv.clone(),
                                 list(prefix.pages), prefix.token_commit, prefix.frame_commit)
        self._target = voice.prompt_tokens[:, :0]  # target tokens so far
        self._prompt_frames = voice.prompt_feat.size(1)
        self._frames_out = self._prompt_frames  # frames (prompt included) returned, or prompt
        self.closed = False

    @property
    def frames_returned(self) -> int:
        """Target mel frames returned so far."""
        return self._frames_out - self._prompt_frames

    @property
    def context_frames(self) -> int:
        """Frames (prompt included) whose estimator state is cached: the next window starts here."""
        return self._state.frame_commit

    @property
    def private_pages(self) -> int:
        return len(self._state.pages) - len(self.voice.state.pages)

    def close(self) -> None:
        """Free the stream's pages and its share of the voice's (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.engine._closed(self, self._state.pages)
        self._state = None


@dataclass
class _Window:
    """One stream's part of a packed run (frames are absolute, prompt included)."""

    stream: EngineStream
    state: _FlowState
    finalize: bool
    frames: int  # frames known after this chunk
    frame_start: int  # first window frame = cached context length
    frame_commit: int  # frames complete after this chunk
    token_commit: int
    mu: torch.Tensor  # (1, 80, frames - frame_start)
    new_pages: list[int]

    @property
    def width(self) -> int:
        return self.frames - self.frame_start


class FlowEngine:
    """Incremental streaming flow over packed rows (see the module docstring). Thread-safe.

    ``pool_bytes``: memory of the page pool (allocated at construction), or ``pool_pages`` pages
    of :attr:`page_bytes` each. ``max_voices``: voice
    prefixes kept (least recently used dropped first; under page pressure unused ones go early).
    ``kernels``: the :class:`FusedEstimator` kernels ("auto": Triton on CUDA in fp16/bf16).
    """

    def __init__(self, flow: CosyVoice2Flow, pool_bytes: int = 0, *, pool_pages: int = 0,
                 max_voices: int = DEFAULT_MAX_VOICES, kernels: str = "auto", n_timesteps: int = N_TIMESTEPS) -> None:
        self.flow = flow
        weight = flow.spk_embed_affine_layer.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.fused = FusedEstimator(flow.decoder, kernels=kernels)
        self.n_timesteps = n_timesteps
        _, self._dt, self._time_bias = self.fused.schedule(n_timesteps)
        layers = len(self.fused.attention_layers)
        page_frames = flow.cfg.estimator.static_chunk_size
        self.page_bytes = PagePool.page_bytes(n_timesteps, layers, page_frames, 2 * self.fused.inner, self.dtype)
        pages = pool_pages or pool_bytes // self.page_bytes
        if pages < 1:
            raise InvalidInputError(
                f"the token2wav state pool of {pool_bytes} bytes holds no page of {self.page_bytes} bytes")
        self.pool = PagePool(pages, n_timesteps, layers, page_frames, 2 * self.fused.inner, self.device, self.dtype)
        self.max_voices = max_voices
        self._voices: OrderedDict[str, VoicePrefix] = OrderedDict()
        self._lock = threading.RLock()
        self.open_streams = 0

    # ----- voices and streams -----

    @staticmethod
    def voice_key(prompt_tokens: torch.Tensor, prompt_feat: torch.Tensor, embedding: torch.Tensor) -> str:
        """Content hash of a voice's flow inputs (two clips with one transcript never collide)."""
        digest = hashlib.blake2b(digest_size=16)
        for tensor in (prompt_tokens.to(torch.long), prompt_feat.float(), embedding.float()):
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()

    @property
    def cached_voices(self) -> int:
        with self._lock:
            return len(self._voices)

    def open(self, prompt_tokens: torch.Tensor, prompt_feat: torch.Tensor, embedding: torch.Tensor) -> EngineStream:
        """A stream of this voice (prompt_tokens (1, P) long, prompt_feat (1, 2P, 80), embedding
        (1, 192)), starting from the voice's cached prefix, computed here on first use."""
        self.flow.check_prompt(prompt_tokens, prompt_feat, embedding, batch=1)
        key = self.voice_key(prompt_tokens, prompt_feat, embedding)
        with self._lock:
            voice = self._voices.get(key)
            if voice is None:
                voice = self._prefix(key, prompt_tokens, prompt_feat, embedding)
                self._voices[key] = voice
                self._trim_voices(self.max_voices)
            self._voices.move_to_end(key)
            voice.streams += 1
            self.open_streams += 1
            return EngineStream(self, voice)

    @torch.inference_mode()
    def _prefix(self, key: str, prompt_tokens, prompt_feat, embedding) -> VoicePrefix:
        flow = self.flow
        tokens = prompt_tokens.to(self.device, torch.long)
        feat = prompt_feat.to(self.device, self.dtype)
        spks = flow.speaker_vector(embedding.to(self.device, self.dtype))
        conv = torch.zeros(self.n_timesteps, 2, self.fused.conv_width, device=self.device, dtype=self.dtype)
        voice = VoicePrefix(key, tokens, feat, spks, _FlowState({}, FrameBuffer(dim=2), conv))
        # The prompt alone, as a non-final chunk without output: its complete blocks are the prefix.
        stream = EngineStream(self, voice)
        try:
            if tokens.size(1) - flow.cfg.pre_lookahead_len >= flow.cfg.encoder.static_chunk_size:
                window = self._window(stream, tokens[:, :0], finalize=False)
                self._run_windows([window])
                self._take_blocks(window)
            voice.state = stream._state
            stream._state = None  # its pages now belong to the voice
            stream.closed = True
        except BaseException:
            stream.close()
            raise
        return voice

    def _trim_voices(self, keep: int) -> int:
        """Drop least recently used voices without open streams down to ``keep``; returns pages freed."""
        freed = 0
        for key in list(self._voices):
            if len(self._voices) <= keep:
                break
            voice = self._voices[key]
            if voice.streams == 0:
                del self._voices[key]
                self.pool.release(voice.state.pages)
                freed += len(voice.state.pages)
        return freed

    def _closed(self, stream: EngineStream, pages: list[int]) -> None:
        with self._lock:
            self.pool.release(pages)
            stream.voice.streams -= 1
            self.open_streams -= 1

    # ----- chunks -----

    def run(self, chunks: list[tuple[EngineStream, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """Step several streams at once: per (stream, target tokens so far (1, n), finalize), the
        float32 mel (1, 80, f) of the frames not returned before.

        A non-final chunk returns frames up to 2(n - 3) (the last 3 tokens are look-ahead), a final
        one up to 2n and closes its stream. A stream that fails (bad tokens, no state pages) is
        closed; an error in the packed run closes every stream of the run.
        """
        with self._lock, torch.inference_mode():
            windows = []
            try:
                for stream, tokens, finalize in chunks:
                    windows.append(self._window(stream, self._validated(stream, tokens, finalize), finalize))
                x = self._run_windows(windows)
            except BaseException:
                for window in windows:
                    self.pool.release(window.new_pages)
                for stream, _, _ in chunks:
                    stream.close()
                raise
            mels = []
            for j, w in enumerate(windows):
                stream = w.stream
                mels.append(x[j, stream._frames_out - w.frame_start:w.width].T[None].float())
                self._take_blocks(w)
                stream._frames_out = w.frames
                if w.finalize:
                    stream.close()
            return mels

    def _validated(self, stream: EngineStream, tokens: torch.Tensor, finalize: bool) -> torch.Tensor:
        flow = self.flow
        if stream.closed:
            raise InvalidInputError("the flow stream is closed (finalized, cancelled or failed)")
        flow.check_ids("tokens_so_far", tokens)
        if tokens.size(0) != 1:
            raise InvalidInputError(f"tokens_so_far must be (1, n), got {tuple(tokens.shape)}")
        flow.check_length(stream.voice.prompt_tokens.size(1), tokens.size(1), finalize)
        tokens = tokens.to(self.device, torch.long)
        seen = stream._target.size(1)
        if tokens.size(1) < seen or not torch.equal(tokens[:, :seen], stream._target):
            raise InvalidInputError(f"tokens_so_far must extend the {seen} tokens of the previous step")
        lookahead = 0 if finalize else flow.cfg.pre_lookahead_len
        frames = stream._prompt_frames + flow.cfg.token_mel_ratio * (tokens.size(1) - lookahead)
        if frames <= stream._frames_out:
            raise InvalidInputError(
                f"{tokens.size(1)} tokens give no frames beyond the {stream.frames_returned} already returned"
                + ("" if finalize else f" (the last {lookahead} tokens are look-ahead only)"))
        stream._target = tokens
        return tokens

    def _window(self, stream: EngineStream, target: torch.Tensor, finalize: bool) -> _Window:
        """Run the encoder over the stream's new tokens; plan its estimator window and pages."""
        flow, cfg, state = self.flow, self.flow.cfg, stream._state
        ratio = cfg.token_mel_ratio
        tokens = torch.cat([stream.voice.prompt_tokens, target], dim=1)
        valid_tokens = tokens.size(1) - (0 if finalize else cfg.pre_lookahead_len)
        token_start = state.token_commit
        token_commit = token_start if finalize else _floor_to(valid_tokens, cfg.encoder.static_chunk_size)
        window = StreamWindow(token_start, token_commit - token_start, state.encoder_states)
        encoder_out = flow.encode(tokens[:, token_start:], streaming=True, finalize=finalize, window=window)
        mu = state.mu.extend(flow.project(encoder_out), commit=ratio * (token_commit - token_start))
        frame_start = state.frame_commit
        frame_commit = frame_start if finalize else _floor_to(ratio * token_commit, self.pool.page_frames)
        new_pages = self.pool.allocate((frame_commit - frame_start) // self.pool.page_frames) or []
        if len(new_pages) * self.pool.page_frames != frame_commit - frame_start:
            freed = self._trim_voices(0)  # unused voices go first
            new_pages = self.pool.allocate((frame_commit - frame_start) // self.pool.page_frames)
            if new_pages is None:
                raise CapacityError(
                    f"the token2wav state pool is full ({self.pool.pages} pages, {freed} freed from unused voices); "
                    "retry later")
        return _Window(stream, state, finalize, ratio * valid_tokens, frame_start, frame_commit, token_commit,
                       mu[:, :, frame_start:], new_pages)

    def _run_windows(self, windows: list[_Window]) -> torch.Tensor:
        """The 10 guided Euler steps of every window, packed; returns x after the last step
        (windows, frames, 80), a view valid until the next run of this shape."""
        fused, pool, page = self.fused, self.pool, self.pool.page_frames
        count = len(windows)
        frames = max(w.width for w in windows)
        widths = [w.width for w in windows]
        contexts = [w.frame_start for w in windows]
        rows = fused.rows(widths * 2, contexts * 2, frames, streaming=True)
        state = fused.new_state(2 * count, rows.slots, frames)
        inp = fused.input_buffer(2 * count, frames)
        for j, w in enumerate(windows):
            end = w.frames
            voice = w.stream.voice
            x = fixed_noise(end, self.device, self.dtype)[:, :, w.frame_start:]
            cond = self.flow.prompt_condition(voice.prompt_feat, w.frame_start, end)
            fused.fill_input(inp, (j, count + j), x, w.mu, voice.spks, cond)
        pair_rows = [torch.tensor([j, count + j], device=self.device) for j in range(count)]
        commit = torch.tensor([w.frame_commit - w.frame_start for w in windows] * 2, device=self.device)
        kept = torch.empty_like(state.conv_all)
        for step in range(self.n_timesteps):
            for j, w in enumerate(windows):
                if w.state.pages:
                    context = pool.data[w.state.pages, step]  # (pages, layers, 2, page, width)
                    state.kv_all[:, pair_rows[j], :w.frame_start] = \
                        context.permute(1, 2, 0, 3, 4).flatten(2, 3)
                state.conv_all[pair_rows[j]] = w.state.conv[step]
            time_bias = self._time_bias[step][:, None, :].expand(-1, 2 * count, -1)
            x_out, _ = fused.step(rows, state, inp, time_bias, self._dt[step].expand(count),
                                  keep_context=(commit, kept))
            for j, w in enumerate(windows):
                if w.finalize:
                    continue
                w.state.conv[step] = kept[pair_rows[j]]
                if w.new_pages:
                    new = state.kv_all[:, pair_rows[j], rows.slots:rows.slots + w.frame_commit - w.frame_start]
                    pool.data[w.new_pages, step] = new.unflatten(2, (len(w.new_pages), page)).permute(2, 0, 1, 3, 4)
        return x_out

    @staticmethod
    def _take_blocks(w: _Window) -> None:
        """The window's complete blocks become the stream's context."""
        w.state.pages += w.new_pages
        w.state.token_commit, w.state.frame_commit = w.token_commit, w.frame_commit


def _floor_to(value: int, multiple: int) -> int:
    return value // multiple * multiple
