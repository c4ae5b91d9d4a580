"""CosyVoice3 token2wav: speech tokens -> 24 kHz waveform (DiT flow + causal HiFT), offline and streaming.

The same :class:`~cosyserve.pipeline.tts.Token2Wav` interface as CosyVoice2's (``offline``, ``step``,
``cancel``), over the model layer's incremental streams:

* offline: one flow call over all tokens (full attention, ``finalize``), one vocoder call;
* streaming: one session per request id, opened at its first step. Each step hands the new mel
  frames to a :class:`~cosyserve.models.cosyvoice3.hift.CausalHiftStream` (only the new frames are
  vocoded, its F0 phase and context carried) and returns only the new samples. The mel comes, by
  ``incremental``:

  - ``True`` (default): from a :class:`~cosyserve.models.cosyvoice3.flow.Cv3FlowStream`, given the
    tokens received since the last step (block-masked DiT: only the frames after the last complete
    50-frame block are sampled, against cached per-Euler-step keys/values);
  - ``False``: the reference Triton runtime's flow, re-run with full attention over all tokens so
    far every step, the frames already sent dropped (``cosyvoice3.md`` §2.4: its TensorRT DiT never
    applies the chunk mask). The reference also re-vocodes the whole mel every chunk; the causal
    vocoder's new samples equal that (parity ``cv3_token2wav``), so both modes vocode new frames only.

Incremental streams of one voice share the flow states of its prompt-only blocks (the voice's
prefix, kept for the last ``voice_prefixes`` voices): the blocks that dominate a first chunk's flow
work are sampled once per voice.

A session closes at its final step, on :meth:`CosyVoice3Token2Wav.cancel`, on any error of its
step, or after ``idle_timeout_s`` without a step (a caller that vanished mid-stream). Per step the
output is 960 samples per token that left the look-ahead (2 mel frames x 480 samples), so the
concatenated stream of ``N`` tokens has ``960·N`` samples, as the reference's.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import InvalidInputError
from ..frontend.prompt import Voice
from ..models.cosyvoice3.dit import POS_CONV_KERNEL, WindowState
from ..models.flow.cfm import N_TIMESTEPS
from ..models.cosyvoice3.flow import Cv3CFM, CosyVoice3Flow, Cv3FlowStream, Cv3VoicePrefix, load_cosyvoice3_flow
from ..models.cosyvoice3.hift import CausalHiFTGenerator, CausalHiftStream, load_causal_hift
from ..runtime import STREAM_IDLE_TIMEOUT_S
from .graphs import capture_graph, frame_bucket
from .sessions import SessionClock, _numpy

DEFAULT_VOICE_PREFIXES = 8  # voices whose prompt-only flow states are kept (see CosyVoice3Token2Wav)


log = logging.getLogger(__name__)

FLOW_SECTION, VOCODER_SECTION = "cosyvoice3.flow", "cosyvoice3.vocoder"  # a step's profiler ranges
DEFAULT_GRAPH_PAST_FRAMES = 2000  # committed frames (prompt included, 50 per second) windows are graphed after
DEFAULT_GRAPH_WINDOW_FRAMES = 400  # frames of a graphed window


@dataclass
class _WindowBuffers:
    """The inputs and outputs every window graph reads and writes, at the largest graphed shape:
    each graph works on leading slices, so the graphs share them (replays are serialised)."""

    z: torch.Tensor  # (1, 80, W)
    mu2: torch.Tensor  # (2, 80, W): CFG rows
    cond2: torch.Tensor
    spks2: torch.Tensor  # (2, 80)
    past_kv: torch.Tensor  # (steps, blocks, 2, 2, heads, P, dim_head)
    conv_context: torch.Tensor  # (steps, 2, 2, D, 30)
    angles: torch.Tensor  # (W, dim_head)
    mask: torch.Tensor  # (W, P + W) bool
    x: torch.Tensor  # outputs: the sampled window (1, 80, W)
    kv: torch.Tensor  # (steps, blocks, 2, 2, heads, W, dim_head)
    inputs1: torch.Tensor  # (steps, 2, D, 30 + W)
    inputs2: torch.Tensor

    @classmethod
    def allocate(cls, decoder: Cv3CFM, past: int, width: int, dtype: torch.dtype, device: torch.device
                 ) -> "_WindowBuffers":
        cfg, context = decoder.estimator.cfg, POS_CONV_KERNEL - 1
        mel = cfg.mel_dim

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(zeros(1, mel, width), zeros(2, mel, width), zeros(2, mel, width), zeros(2, mel),
                   zeros(N_TIMESTEPS, cfg.depth, 2, 2, cfg.heads, past, cfg.dim_head),
                   zeros(N_TIMESTEPS, 2, 2, cfg.dim, context),
                   torch.zeros(width, cfg.dim_head, dtype=decoder.estimator.rotary_embed.inv_freq.dtype, device=device),
                   torch.zeros(width, past + width, dtype=torch.bool, device=device),
                   zeros(1, mel, width), zeros(N_TIMESTEPS, cfg.depth, 2, 2, cfg.heads, width, cfg.dim_head),
                   zeros(N_TIMESTEPS, 2, cfg.dim, context + width), zeros(N_TIMESTEPS, 2, cfg.dim, context + width))


class Cv3WindowGraphs:
    """A :data:`~cosyserve.models.cosyvoice3.flow.WindowSampler` that replays one stream's window
    sampling (10 Euler steps x 22 DiT blocks: ~10k kernels in eager mode, whose launches, not the
    arithmetic, bound a step on the GPU) from a CUDA graph per padded shape.

    The window is padded on the right to a :func:`~cosyserve.token2wav.graphs.frame_bucket`, and the
    committed frames' keys/values to another (multiples of 50 frames, then ~25 % apart): padded keys
    are hidden by the attention mask, padded frames follow the real ones (the position
    convolutions are causal) and are dropped, so the output equals the eager one up to rounding.
    All graphs read and write leading slices of one set of buffers sized for ``max_past`` committed
    frames and ``max_window`` window frames (:class:`_WindowBuffers`; ~0.9 MB per frame of keys and
    values in bfloat16: ~2 GB at the defaults) and share one memory pool for their temporaries, so
    graph memory does not grow with the number of shapes. A shape is captured the first time it is
    seen (after ``capture_after`` eager runs; a capture costs about two eager runs, and bucketed shapes
    recur); larger windows or pasts always run eagerly.
    ``cuda_graphs=False`` runs the padded buffers eagerly instead of capturing them (any device: it
    checks that the padding changes nothing)."""

    def __init__(self, decoder: Cv3CFM, *, max_past: int = DEFAULT_GRAPH_PAST_FRAMES,
                 max_window: int = DEFAULT_GRAPH_WINDOW_FRAMES, capture_after: int = 0, cuda_graphs: bool = True):
        self.decoder = decoder
        self.cuda_graphs = cuda_graphs
        self.max_past, self.max_window = frame_bucket(max_past), frame_bucket(max_window)
        self.capture_after = capture_after
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._seen: Counter = Counter()
        self._failed: set[tuple[int, int]] = set()  # shapes whose capture failed
        self._buffers: _WindowBuffers | None = None
        self._pool = None
        self._lock = threading.Lock()
        self.calls = self.eager_calls = 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def __call__(self, z, mu2, cond2, spks2, state: WindowState) -> tuple[torch.Tensor, ...]:
        estimator, width, start = self.decoder.estimator, z.shape[2], state.frames
        padded_width, past = frame_bucket(width), frame_bucket(start) if start else 0
        key = (past, padded_width)
        with self._lock:
            self.calls += 1
            graph = self._graphs.get(key)
            if graph is None:
                self._seen[key] += 1
                if padded_width > self.max_window or past > self.max_past or padded_width < width or past < start \
                        or mu2.shape[0] != 2 or self._seen[key] <= self.capture_after or key in self._failed:
                    return self._eager(z, mu2, cond2, spks2, state)
            buffers = self._load(z, mu2, cond2, spks2, state, past, padded_width)
            if not self.cuda_graphs:
                self._padded_run(buffers, past, padded_width)()
            else:
                if graph is None:
                    try:
                        if self._pool is None:
                            self._pool = torch.cuda.graph_pool_handle()
                        graph, _ = capture_graph(self._padded_run(buffers, past, padded_width), z.device, self._pool)
                    except RuntimeError:  # a failed capture costs speed, never the request
                        log.exception("capturing the CosyVoice3 window graph %s failed; that shape runs eagerly", key)
                        self._failed.add(key)
                        return self._eager(z, mu2, cond2, spks2, state)
                    self._graphs[key] = graph
                graph.replay()
            context = POS_CONV_KERNEL - 1
            return (buffers.x[..., :width].clone(), buffers.kv[..., :width, :].clone(),
                    buffers.inputs1[..., :context + width].clone(), buffers.inputs2[..., :context + width].clone())

    def _eager(self, z, mu2, cond2, spks2, state: WindowState) -> tuple[torch.Tensor, ...]:
        self.eager_calls += 1
        return self.decoder.sample_state_window(z, mu2, cond2, spks2, state)

    def _load(self, z, mu2, cond2, spks2, state: WindowState, past: int, padded_width: int) -> _WindowBuffers:
        """Copy one window into the shared buffers' leading slices (padding zeroed)."""
        if self._buffers is None:
            self._buffers = _WindowBuffers.allocate(self.decoder, self.max_past, self.max_window, z.dtype, z.device)
        b, width, start = self._buffers, z.shape[2], state.frames
        for buffer, value in ((b.z, z), (b.mu2, mu2), (b.cond2, cond2)):
            buffer[..., :width].copy_(value)
            buffer[..., width:padded_width].zero_()
        b.spks2.copy_(spks2)
        if state.kv is None:
            b.conv_context.zero_()
        else:
            b.past_kv[..., :start, :].copy_(state.kv)
            b.conv_context.copy_(state.conv_context)
        b.past_kv[..., start:past, :].zero_()  # hidden by the mask; zeros keep stale values out
        angles, mask = self.decoder.estimator.window_geometry(start, width, past, padded_width)
        b.angles[:padded_width].copy_(angles)
        b.mask[:padded_width, :past + padded_width].copy_(mask)
        return b

    def _padded_run(self, b: _WindowBuffers, past: int, padded_width: int):
        """The work one graph holds: the window sampled from the buffers' leading slices into them."""
        context = POS_CONV_KERNEL - 1

        def run() -> None:
            x, kv, inputs1, inputs2 = self.decoder.sample_window(
                b.z[..., :padded_width], b.mu2[..., :padded_width], b.cond2[..., :padded_width], b.spks2,
                b.past_kv[..., :past, :], b.conv_context, b.angles[:padded_width],
                b.mask[:padded_width, :past + padded_width])
            b.x[..., :padded_width].copy_(x)
            b.kv[..., :padded_width, :].copy_(kv)
            b.inputs1[..., :context + padded_width].copy_(inputs1)
            b.inputs2[..., :context + padded_width].copy_(inputs2)

        return run


@dataclass
class Cv3Session:
    """One request's streaming state: its flow and vocoder streams and how many tokens they have."""

    flow: Cv3FlowStream | None  # None: the re-run flow (``incremental=False``)
    vocoder: CausalHiftStream
    prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    voice_key: bytes  # b"" when no prefixes are kept
    received: int = 0
    frames: int = 0  # mel frames sent so far (the re-run flow's)


class CosyVoice3Token2Wav:
    """Flow in ``dtype`` on ``device``; the causal HiFT in float32 (its F0 predictor in float64, as
    upstream). Thread-safe: sessions are looked up under a lock, each session's step runs under its
    own (a request steps in order; different requests may step at once). ``incremental``: how a
    stream's mel is computed (module docstring).

    Incremental streams of one voice share the estimator states of its prompt-only blocks
    (:class:`~cosyserve.models.cosyvoice3.flow.Cv3VoicePrefix`): the first stream of a voice samples
    them apart, the next ones start after them. The last ``voice_prefixes`` voices' are kept (0:
    none), keyed by the voice's features (two voices with one transcript never collide).
    Real-size, a 5 s prompt's prefix holds 200 frames x 22 layers x 10 steps of keys and values:
    ~720 MB in float32, ~360 MB in bfloat16."""

    def __init__(self, flow: CosyVoice3Flow, hift: CausalHiFTGenerator, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S,
                 incremental: bool = True, voice_prefixes: int = DEFAULT_VOICE_PREFIXES,
                 cuda_graphs: bool = False):
        self.device = torch.device(device)
        self.dtype = dtype
        self.incremental = incremental
        self.voice_prefixes = voice_prefixes
        self._prefixes: OrderedDict[bytes, Cv3VoicePrefix] = OrderedDict()
        self.prefix_hits = self.prefix_misses = 0
        self.flow = flow.to(device=self.device, dtype=dtype).eval()
        # incremental streams' windows from CUDA graphs (the re-run and offline flows stay eager)
        self.window_graphs = Cv3WindowGraphs(self.flow.decoder) if cuda_graphs and self.device.type == "cuda" \
            else None
        self.hift = hift.to(device=self.device).eval()
        self.idle_timeout_s = idle_timeout_s
        self._sessions: dict[str, Cv3Session] = {}
        self._session_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._clock = SessionClock()

    @property
    def open_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    @property
    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def _prompt(self, voice: Voice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prompt tokens (1, P), prompt mel (1, 2P, 80), embedding (1, 192)) on the device."""
        f = voice.features
        return (f.speech_tokens.reshape(1, -1).to(self.device, torch.long),
                f.speech_feat.reshape(1, -1, f.speech_feat.shape[-1]).to(self.device, self.dtype),
                f.embedding.reshape(1, -1).to(self.device, self.dtype))

    def _tokens(self, tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64).reshape(-1), device=self.device).reshape(1, -1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.flow.cfg.vocab_size):
            raise InvalidInputError(f"speech tokens must be in 0..{self.flow.cfg.vocab_size - 1}; got "
                                    f"{int(ids.min())}..{int(ids.max())}")
        return ids

    @torch.inference_mode()
    def offline(self, request_id: str, tokens: Sequence[int], voice: Voice) -> np.ndarray:
        ids = self._tokens(tokens)
        if ids.numel() == 0:
            raise InvalidInputError("no speech tokens to synthesise")
        mel = self.flow.inference(ids, *self._prompt(voice), streaming=False, finalize=True)
        speech, _ = self.hift.inference(mel, finalize=True)
        return _numpy(speech)

    def step(self, request_id: str, tokens: Sequence[int], voice: Voice | None, token_offset: int,
             finalize: bool) -> np.ndarray:
        """``tokens`` are all the request's tokens so far (as the reference BLS sends them); the
        ones after the previous step's are new. Returns the new samples. ``voice`` is read when the
        session opens (None is accepted once it is open)."""
        self.close_idle()
        session, lock = self._open(request_id, voice)
        try:
            with lock, torch.inference_mode():
                ids = self._tokens(tokens)
                if ids.shape[1] < session.received or token_offset < 0 or token_offset > ids.shape[1]:
                    raise InvalidInputError(
                        f"request {request_id!r}: step with {ids.shape[1]} tokens and token_offset {token_offset} "
                        f"after {session.received} tokens; send all tokens so far, offset within them")
                with torch.profiler.record_function(FLOW_SECTION):  # named ranges for token2wav.py --profile
                    if session.flow is not None:
                        mel = session.flow.push(ids[:, session.received:], finalize)
                        self._keep_prefix(session)
                    else:
                        mel = self._rerun(session, ids, finalize)
                session.received = ids.shape[1]
                with torch.profiler.record_function(VOCODER_SECTION):
                    speech = session.vocoder.push(mel, finalize)
        except BaseException:
            self.cancel(request_id)
            raise
        if finalize:
            self.cancel(request_id)
        else:
            self._clock.stepped(request_id, closed=False)
        return _numpy(speech)

    def _open(self, request_id: str, voice: Voice | None) -> tuple[Cv3Session, threading.Lock]:
        with self._lock:
            session = self._sessions.get(request_id)
            if session is None:
                if voice is None:
                    raise InvalidInputError(f"request {request_id!r} has no open streaming session; its first "
                                            "step must carry the voice (prompt tokens, mel and embedding)")
                prompt = self._prompt(voice)
                key = voice_key(voice) if self.incremental and self.voice_prefixes else b""
                flow = self._flow_stream(prompt, key) if self.incremental else None
                session = Cv3Session(flow, CausalHiftStream(self.hift), prompt, key)
                self._sessions[request_id] = session
                self._session_locks[request_id] = threading.Lock()
            return session, self._session_locks[request_id]

    def _flow_stream(self, prompt: tuple, key: bytes) -> Cv3FlowStream:
        """A voice's incremental flow, after its cached prefix when there is one (called under the lock)."""
        prefix = self._prefixes.get(key)
        if prefix is not None:
            self._prefixes.move_to_end(key)
            self.prefix_hits += 1
        elif self.voice_prefixes:
            self.prefix_misses += 1
        return Cv3FlowStream(self.flow, *prompt, prefix=prefix, keep_prefix=self.voice_prefixes > 0,
                             sampler=self.window_graphs)

    def _keep_prefix(self, session: Cv3Session) -> None:
        """Keep the prefix a voice's first stream has sampled (the least recently used one goes)."""
        prefix = session.flow.prefix
        if prefix is None or not self.voice_prefixes:
            return
        with self._lock:
            if session.voice_key not in self._prefixes:
                self._prefixes[session.voice_key] = prefix
                while len(self._prefixes) > self.voice_prefixes:
                    self._prefixes.popitem(last=False)

    @property
    def cached_voices(self) -> int:
        with self._lock:
            return len(self._prefixes)

    def _rerun(self, session: Cv3Session, ids: torch.Tensor, finalize: bool) -> torch.Tensor:
        """The reference's step: the full-attention flow over every token so far (a non-final one
        keeps the last ``pre_lookahead_len`` as look-ahead), less the frames already sent."""
        lookahead = 0 if finalize else self.flow.cfg.pre_lookahead_len
        if ids.shape[1] <= lookahead:
            return torch.zeros(1, self.flow.cfg.output_size, 0, device=self.device)
        mel = self.flow.inference(ids, *session.prompt, streaming=False, finalize=finalize)
        new, session.frames = mel[:, :, session.frames:], max(session.frames, mel.shape[2])
        return new

    def cancel(self, request_id: str) -> None:
        """Close the request's session (harmless when it has none)."""
        self._clock.forget(request_id)
        with self._lock:
            self._sessions.pop(request_id, None)
            self._session_locks.pop(request_id, None)

    def close_idle(self) -> list[str]:
        """Close sessions whose last step is older than the idle timeout; returns their ids."""
        stale = self._clock.idle(self.idle_timeout_s)
        for request_id in stale:
            self.cancel(request_id)
        return stale


def voice_key(voice: Voice) -> bytes:
    """What identifies a voice to token2wav: a digest of its features (prompt tokens, mel, embedding)."""
    digest = hashlib.blake2b(digest_size=16)
    f = voice.features
    for tensor in (f.speech_tokens, f.speech_feat, f.embedding):
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.digest()


def load_cosyvoice3_token2wav(model_dir: str | Path, device: torch.device | str = "cpu",
                              dtype: torch.dtype = torch.float32,
                              idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S,
                              incremental: bool = True,
                              voice_prefixes: int = DEFAULT_VOICE_PREFIXES,
                              cuda_graphs: bool = False) -> CosyVoice3Token2Wav:
    """``Fun-CosyVoice3-0.5B-2512/`` (cosyvoice3.yaml, flow.pt, hift.pt) -> :class:`CosyVoice3Token2Wav`."""
    flow = load_cosyvoice3_flow(model_dir, device, dtype)
    hift = load_causal_hift(model_dir, device)
    return CosyVoice3Token2Wav(flow, hift, device, dtype, idle_timeout_s, incremental, voice_prefixes, cuda_graphs)
