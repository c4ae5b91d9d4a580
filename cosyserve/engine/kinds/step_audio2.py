"""Step-Audio2's token2wav (the Step-Audio-2-mini flow with a DiT estimator, and HiFT) as a kind
of the engine: the same audio as :class:`~cosyserve.token2wav.step_audio2.StepAudio2Stream` and
:func:`~cosyserve.token2wav.step_audio2.offline_waveforms`, a batch of flow jobs solved together
(:meth:`StepAudio2Kind.solve`: its Euler steps, each as few estimator calls as the jobs' lengths
allow).

Voices. The kind takes :class:`~cosyserve.frontend.prompt.PromptFeatures` with *raw* speech tokens
(0..6560, S3 tokenizer v2 at 25 Hz), the 24 kHz prompt log-mel (fmax 8 kHz, time-major) and the
CAM++ embedding, as :func:`step_audio2_prompt_features` makes them from a 16 kHz clip with the
model directory's own ``speech_tokenizer_v2_25hz.onnx`` and ``campplus.onnx`` (a VoiceResolver
over :func:`load_step_audio2_frontend` makes the same for clips and stored voices; registered
voices of ``spk2info.pt`` are used as they are). Features are cut to n = min(M // 2, n_p) tokens
and 2n frames (:func:`aligned_features`) for streams and offline requests alike, so every speech
token yields exactly 960 samples. A voice's streaming state (the prompt run once through the
flow, :class:`~cosyserve.token2wav.step_audio2.VoiceState`) is kept per digest of its features, for the
last ``max_voices`` voices; a stream keeps its voice's state even after eviction.

Streams. A voicing is one stream: its flow caches (shared with the voice until its first chunk)
and its :class:`~cosyserve.token2wav.vocoder_stream.HiftStream`. Chunks come from
:class:`~cosyserve.schedule.StepAudio2ChunkScheduler`; a chunk job runs the encoder on the chunk's new
tokens when it starts, then takes ``n_timesteps`` estimator steps; on its last step the stream's
caches become the chunk's (estimator cache trimmed as upstream does).

Speech tokens are raw ids: a Step-Audio2 LLM's audio-token ids must be shifted back before they
reach the engine (out-of-range ids raise InvalidInputError before any model work).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...audio.io import TOKENIZER_SAMPLE_RATE, prompt_audio_from_array
from ...errors import InvalidInputError
from ...frontend.prompt import PromptFeatures, build_prompt_features, trim_to_token_rate
from ...frontend.torch_models import load_frontend_models
from ...lru import LruCache
from ...models.flow.cfm import cosine_time_grid
from ...models.step_audio2.cfm import EstimatorCache
from ...models.step_audio2.estimator import CONV_KERNEL, DiT, DitBlock, modulate
from ...models.step_audio2.flow import FlowStreamCache
from ...schedule import StepAudio2ChunkScheduler
from ...speech_tokens import speech_token_ids
from ...token2wav.cosyvoice2 import default_flow_dtype
from ...token2wav.step_audio2 import (DEFAULT_MAX_VOICES, ESTIMATOR_CACHE_KEEP, STEP_AUDIO2_SPEAKER_ONNX,
                                      STEP_AUDIO2_TOKENIZER_ONNX, StepAudio2Models, VoicePrompt, VoiceState,
                                      build_voice_state, load_step_audio2)
from ...token2wav.graphs import HiftRunner
from ...token2wav.vocoder_batch import source_noise, vocode_batch
from ...token2wav.vocoder_stream import HiftStream, SineNoiseProvider, VocoderCall

# Jobs shorter than this many frames share one estimator call; longer ones are packed with jobs of
# the same power-of-two length class, so that padding at most doubles a call's work.
PACK_MIN_FRAMES = 64
WARM_UP_TOKENS = 40  # a first chunk and a final one


# ----------------------------------------------------------------------------- voices
def aligned_features(features: PromptFeatures) -> PromptFeatures:
    """``features`` cut to n = min(M // 2, n_p) tokens and 2n mel frames (a no-op when aligned)."""
    tokens, feat = trim_to_token_rate(features.speech_tokens.reshape(-1), features.speech_feat)
    return PromptFeatures(tokens, feat, features.embedding)


def load_step_audio2_frontend(model_dir: str | Path, device: str | torch.device = "cpu",
                              backend: str | None = None):
    """(speech tokenizer, speaker encoder) of a Step-Audio-2-mini ``token2wav`` directory, for a
    :class:`~cosyserve.engine.front_end.VoiceResolver` of this kind (default ``mel_fmax``)."""
    model_dir = Path(model_dir)
    return load_frontend_models(model_dir / STEP_AUDIO2_TOKENIZER_ONNX, model_dir / STEP_AUDIO2_SPEAKER_ONNX, device, backend)


def step_audio2_prompt_features(wav16: Any, tokenizer: Any, speaker_encoder: Any) -> PromptFeatures:
    """A 16 kHz reference clip -> the features this kind takes (what the engine's VoiceResolver computes)."""
    audio = prompt_audio_from_array(wav16, TOKENIZER_SAMPLE_RATE)
    return build_prompt_features(audio, tokenizer, speaker_encoder)


# ----------------------------------------------------------------------------- streams and jobs
@dataclass(eq=False)
class StepAudio2Voicing:
    """One stream: its voice's state, its flow caches and its vocoder."""

    kind: "StepAudio2Kind"
    speaker: VoiceState | None
    cache: FlowStreamCache | None  # the voice's caches until the first chunk replaces them
    vocoder: HiftStream

    @property
    def closed(self) -> bool:
        return self.speaker is None

    def close(self) -> None:
        """Release the stream's caches (idempotent)."""
        if self.speaker is None:
            return
        self.speaker = self.cache = None
        self.vocoder.close()
        self.kind._stream_closed()


@dataclass(eq=False)
class StepAudio2Job:
    """One chunk's (or offline request's) flow: x after ``steps_done`` Euler steps.

    ``mu2``/``spks2``/``cond2`` hold the conditional row and the zeroed row of classifier-free
    guidance. A chunk reads its stream's per-step estimator caches (``read``) and collects the
    new ones; an offline job has none (zero conv history, no cached frames)."""

    finalize: bool
    voicing: StepAudio2Voicing | None
    x: torch.Tensor | None  # (1, 80, T)
    mu2: torch.Tensor | None = None  # (2, 80, T)
    spks2: torch.Tensor | None = None  # (2, 80)
    cond2: torch.Tensor | None = None  # (2, 80, T)
    read: EstimatorCache | None = None  # chunk: the stream's caches before the chunk
    encoder: Any = None  # chunk: the encoder cache after the chunk
    mel_from: int = 0  # offline: frames of the prompt mel, not voiced
    steps_done: int = 0
    total_steps: int = 0
    t: torch.Tensor | None = None
    dt: torch.Tensor | None = None
    new_cnn: list = field(default_factory=list)
    new_att: list = field(default_factory=list)

    @property
    def frames(self) -> int:
        """Estimator frames it adds to a batch."""
        return 0 if self.x is None else self.x.shape[2]

    @property
    def done(self) -> bool:
        return self.steps_done >= self.total_steps

    def release(self) -> None:
        self.mu2 = self.spks2 = self.cond2 = self.read = self.encoder = None
        self.new_cnn, self.new_att = [], []
        self.steps_done = self.total_steps


class StepAudio2Kind:
    """Over loaded :class:`~cosyserve.token2wav.step_audio2.StepAudio2Models`. ``sine_noise``:
    HiFT's harmonic noise for every call (tests: zero noise), else drawn per call. ``vocoder``: the
    HiFT runner of the batched calls (default eager)."""

    name = "step_audio2"
    final_full_pass = False  # a final chunk is its last tokens' window
    cold_start = False  # a stream needs its voice's state (built by open when not kept)
    prepares_beside = False  # its voices' state is computed on the loop's stream and thread
    sample_rate = 24000

    def __init__(self, models: StepAudio2Models, *, max_voices: int = DEFAULT_MAX_VOICES,
                 sine_noise: SineNoiseProvider | None = None, vocoder: HiftRunner | None = None) -> None:
        if max_voices < 1:
            raise InvalidInputError("max_voices must be at least 1")
        self.models = models
        self.flow = models.flow
        self.max_voices = max_voices
        self.sine_noise = sine_noise
        self.vocoder = vocoder or HiftRunner(models.hift)  # eager unless given one with CUDA graphs
        self.device = self.flow.encoder_proj.weight.device
        self.dtype = self.flow.encoder_proj.weight.dtype
        self.n_steps = self.flow.decoder.n_timesteps
        self._t_span = cosine_time_grid(self.n_steps, self.device, self.dtype)
        self._voices: LruCache[str, VoiceState] = LruCache(max_voices)
        self._open = 0
        self._lock = threading.Lock()

    def chunk_schedule(self, strategy: str) -> StepAudio2ChunkScheduler:
        return StepAudio2ChunkScheduler(strategy, self.flow.pre_lookahead_len)

    # ----- voices and streams -----

    @property
    def cached_voices(self) -> list[str]:
        return self._voices.keys()

    @property
    def open_streams(self) -> int:
        with self._lock:
            return self._open

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The kind's state as gauges (``cosyserve_token2wav_<name>``): name -> (help, value)."""
        with self._lock:
            return {"open_streams": ("Step-Audio2 streams holding flow caches", self._open),
                    "voices_cached": ("voices whose prompt state is kept", len(self._voices))}

    def _stream_closed(self) -> None:
        with self._lock:
            self._open -= 1

    def _speaker(self, features: PromptFeatures) -> VoiceState:
        key = aligned_features(features).key()
        state = self._voices.get(key)
        if state is None:
            # aligned there too (n = min(M // 2, n_p)), then run through the flow once
            state = build_voice_state(self.flow, VoicePrompt(features.speech_tokens, features.speech_feat,
                                                             features.embedding))
            self._voices.put(key, state)  # open streams of an evicted voice keep their own reference
        return state

    def cold_frames(self, features: PromptFeatures) -> int:
        return 0  # open builds the voice's state when it is not kept: no window carries the prompt

    def open(self, features: PromptFeatures) -> StepAudio2Voicing:
        """A stream of ``features``' voice; the voice's state is built here on first use."""
        speaker = self._speaker(features)
        voicing = StepAudio2Voicing(self, speaker, speaker.flow_cache, HiftStream(self.models.hift,
                                                                                  sine_noise=self.sine_noise))
        with self._lock:
            self._open += 1
        return voicing

    def prepare_voices(self, voices: list[PromptFeatures]) -> None:
        """Build and keep these voices' state (registered ones at load, a new one when its request arrives)."""
        for features in voices:
            self._speaker(features)

    def warm_up(self, features: PromptFeatures) -> None:
        """Run a short stream and an offline request of ``features``' voice through every stage."""
        prompt = features.speech_tokens.reshape(-1).tolist()
        tokens = (prompt * (WARM_UP_TOKENS // max(len(prompt), 1) + 1))[:WARM_UP_TOKENS]
        schedule = self.chunk_schedule("exponential")
        voicing = self.open(features)
        try:
            for chunk in (schedule.next_chunk(len(tokens)), schedule.final_chunk(len(tokens))):
                self._run([voicing], self.start_chunks([(voicing, tokens[:chunk.num_tokens], chunk.token_offset,
                                                         chunk.finalize)]))
            self._run([None], [self.start_offline(features, tokens[:20])])
        finally:
            voicing.close()

    def _run(self, voicings, jobs) -> list[torch.Tensor]:
        self.solve(jobs)
        return self.vocode([(v, self.mel(job), job.finalize) for v, job in zip(voicings, jobs)])

    # ----- flow jobs -----

    def start_chunks(self, chunks: list[tuple[StepAudio2Voicing, list[int], int, bool]]) -> list[StepAudio2Job]:
        """Flow jobs of streams' chunks: (voicing, tokens so far, tokens already voiced, finalize).
        Every chunk is checked before any of them runs its encoder."""
        news = [self._check_chunk(voicing, tokens[offset:], finalize) for voicing, tokens, offset, finalize in chunks]
        return [self._start_chunk(voicing, new, finalize) for (voicing, _, _, finalize), new in zip(chunks, news)]

    def _check_chunk(self, voicing: StepAudio2Voicing, tokens: list[int], finalize: bool) -> torch.Tensor:
        if voicing.closed:
            raise InvalidInputError("this Step-Audio2 stream is closed")
        new = speech_token_ids(tokens, self.flow.cfg.vocab_size)
        lookahead, r = self.flow.pre_lookahead_len, self.flow.up_rate
        voiced = new.numel() if finalize else new.numel() - lookahead
        if voiced <= 0 and not finalize:
            raise InvalidInputError(f"a chunk that is not the last needs more than {lookahead} tokens "
                                    f"(its last {lookahead} are look-ahead); got {new.numel()}")
        frames = r * voiced
        if voicing.cache.encoder.frames + frames > self.flow.cfg.encoder.max_positions:
            raise InvalidInputError(f"stream too long: {voicing.cache.encoder.frames + frames} mel frames (prompt "
                                    f"included) exceed the encoder's {self.flow.cfg.encoder.max_positions}")
        if voicing.cache.estimator.frames + frames > self.flow.cfg.noise_frames:
            raise InvalidInputError("chunk too long for the fixed streaming noise buffer")
        return new

    @torch.inference_mode()
    def _start_chunk(self, voicing: StepAudio2Voicing, new: torch.Tensor, finalize: bool) -> StepAudio2Job:
        if new.numel() == 0:  # nothing new to voice: the vocoder only flushes its withheld tail
            return StepAudio2Job(finalize, voicing, torch.zeros(1, self.flow.cfg.output_size, 0, device=self.device))
        flow, cache = self.flow, voicing.cache
        embedded = flow.input_embedding(new[None].to(self.device))
        h, encoder = flow.encoder.forward_chunk(embedded, finalize, cache.encoder)
        mu = flow.encoder_proj(h).transpose(1, 2)
        noise = flow.decoder.noise_slice(cache.estimator.frames, mu.shape[2]).to(mu.dtype)
        return self._job(finalize, voicing, noise, mu, voicing.speaker.spk_proj.to(mu.dtype), torch.zeros_like(mu),
                         read=cache.estimator, encoder=encoder)

    @torch.inference_mode()
    def start_offline(self, features: PromptFeatures, tokens: list[int]) -> StepAudio2Job:
        """The flow over prompt ‖ tokens with the prompt mel as condition (as :func:`~cosyserve.token2wav.step_audio2.offline_waveforms`)."""
        target = speech_token_ids(tokens, self.flow.cfg.vocab_size)
        features = aligned_features(features)
        prompt = speech_token_ids(features.speech_tokens.tolist(), self.flow.cfg.vocab_size)
        flow, r = self.flow, self.flow.up_rate
        ids = torch.cat([prompt, target])[None].to(self.device)
        noise = flow.decoder.noise_slice(0, r * ids.shape[1])
        mu, _ = flow.encode(ids, torch.tensor([ids.shape[1]], device=self.device))
        cond = torch.zeros_like(mu)
        prompt_frames = features.speech_feat.shape[0]
        cond[:, :, :prompt_frames] = features.speech_feat.to(self.device, mu.dtype).T[None]
        spks = flow.project_speaker(features.embedding.reshape(1, -1))
        return self._job(True, None, noise.to(mu.dtype), mu, spks, cond, mel_from=prompt_frames)

    def _job(self, finalize, voicing, noise, mu, spks, cond, **kwargs) -> StepAudio2Job:
        def with_uncond(v: torch.Tensor) -> torch.Tensor:
            return torch.cat([v, torch.zeros_like(v)])

        return StepAudio2Job(finalize, voicing, noise.clone(), with_uncond(mu), with_uncond(spks), with_uncond(cond),
                             total_steps=self.n_steps, t=self._t_span[0], dt=self._t_span[1] - self._t_span[0],
                             **kwargs)

    def solve(self, jobs: list[StepAudio2Job]) -> None:
        """Every Euler step of every job (started together), launched."""
        while not all(job.done for job in jobs):
            self.step(jobs)

    @torch.inference_mode()
    def step(self, jobs: list[StepAudio2Job]) -> None:
        """One Euler step of every unfinished job; jobs of one length class share an estimator call."""
        groups: dict[int, list[StepAudio2Job]] = {}
        for job in jobs:
            if not job.done:
                size = max(PACK_MIN_FRAMES, 1 << max(job.frames - 1, 0).bit_length())
                groups.setdefault(size, []).append(job)
        for members in groups.values():
            self._step_group(members)

    def _step_group(self, jobs: list[StepAudio2Job]) -> None:
        est, cfg_rate = self.flow.decoder.estimator, self.flow.decoder.cfg_rate
        frames = [job.frames for job in jobs]
        reads = [self._read_caches(job) for job in jobs]
        cached = [att.shape[3] for _, att in reads]
        velocity, cnn, att = packed_estimator_step(
            est, [torch.cat([job.x, job.x]) for job in jobs], [job.mu2 for job in jobs],
            [job.spks2 for job in jobs], [job.cond2 for job in jobs], [job.t for job in jobs], reads)
        top = max(frames)
        for i, job in enumerate(jobs):
            rows = slice(2 * i, 2 * i + 2)
            v_cond, v_uncond = velocity[rows, :, :frames[i]].chunk(2, dim=0)
            job.x = job.x + job.dt * ((1.0 + cfg_rate) * v_cond - cfg_rate * v_uncond)
            job.t = job.t + job.dt
            job.steps_done += 1
            if job.steps_done < job.total_steps:
                job.dt = self._t_span[job.steps_done + 1] - job.t
            if job.voicing is not None:  # the stream's next caches: [new frames ‖ cached frames]
                job.new_cnn.append(cnn[:, rows])
                new, kept = att[:, rows, :, :frames[i]], att[:, rows, :, top:top + cached[i]]
                job.new_att.append(torch.cat([new, kept], dim=3))
                if job.done:
                    self._commit(job)

    def _read_caches(self, job: StepAudio2Job) -> tuple[torch.Tensor, torch.Tensor]:
        if job.read is None:  # offline: no history
            return self.flow.decoder.estimator.empty_caches(2, self.device, self.dtype)
        return job.read.cnn[job.steps_done], job.read.att[job.steps_done]

    def _commit(self, job: StepAudio2Job) -> None:
        """The stream's caches after its chunk (the estimator's trimmed as StepAudio2Stream trims them)."""
        voicing = job.voicing
        if not voicing.closed:
            estimator = EstimatorCache(torch.stack(job.new_cnn), torch.stack(job.new_att))
            voicing.cache = FlowStreamCache(job.encoder, estimator.trimmed(voicing.speaker.prompt_frames,
                                                                           ESTIMATOR_CACHE_KEEP))
        job.read = job.encoder = None
        job.new_cnn, job.new_att = [], []

    def mel(self, job: StepAudio2Job) -> torch.Tensor:
        """A done job's new mel (1, 80, F) float32."""
        return job.x[:, :, job.mel_from:].float()

    def abort(self, jobs: list[StepAudio2Job]) -> None:
        """Release what the jobs hold (their streams are closed by their owners)."""
        for job in jobs:
            job.release()

    # ----- vocoder -----

    def vocode(self, items: list[tuple[StepAudio2Voicing | None, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """PCM (1-D float32 on the device, launched) of each (stream's voicing, or None for an
        offline request; mel; final chunk), HiFT calls of equal shape batched."""
        hift = self.models.hift
        calls = [v.vocoder.prepare(mel, finalize=final) if v is not None else
                 VocoderCall(mel, None, True, hift.hop_length, mel.shape[2] > 0) for v, mel, final in items]
        harmonics, device = hift.m_source.num_harmonics, hift.conv_pre.weight.device
        noises = [source_noise(call, harmonics, device, None, self.sine_noise) if call.needed else None
                  for call in calls]
        outputs = vocode_batch(self.vocoder, calls, noises)
        pcm = []
        for (voicing, _, _), call, output in zip(items, calls, outputs):
            if voicing is None:
                audio = output[0][0] if output is not None else torch.zeros(0, device=device)
            else:
                raw, source = output if output is not None else (None, None)
                audio = voicing.vocoder.complete(call, raw, source).audio[0]
            pcm.append(audio.detach().to(torch.float32))
        return pcm


# ----------------------------------------------------------------------------- packed estimator
def packed_estimator_step(est: DiT, xs, mus, spks, conds, ts, caches):
    """One estimator call over several jobs (2 rows each: conditional, unconditional) of different
    lengths T_j and cached frames C_j: inputs right-padded to T = max T_j, caches to C = max C_j,
    padded keys masked out and each row's conv history taken at its own length, so every row's
    valid frames get what :meth:`DiT.forward_chunk` gives the job alone. ``caches``: per job
    (conv cache (depth, 2, 2H, 2), attention cache (depth, 2, heads, C_j, 2D)). Returns the velocity
    (2J, 80, T), the conv caches (depth, 2J, 2H, 2) and the attention caches (depth, 2J, heads, T + C,
    2D) = [new frames (padded to T) ‖ cached frames (padded to C)]."""
    frames = [x.shape[2] for x in xs]
    cached = [att.shape[3] for _, att in caches]
    top, most = max(frames), max(cached)
    pad = lambda v, n: F.pad(v, (0, n - v.shape[-1]))  # noqa: E731
    x = torch.cat([pad(v, top) for v in xs])
    mu = torch.cat([pad(v, top) for v in mus])
    cond = torch.cat([pad(v, top) for v in conds])
    t = torch.cat([v.reshape(1).expand(2) for v in ts])
    cnn = torch.cat([c for c, _ in caches], dim=1)
    att = torch.cat([F.pad(a, (0, 0, 0, most - a.shape[3])) for _, a in caches], dim=1)
    lengths = torch.tensor([n for n in frames for _ in range(2)], device=x.device)
    key_mask = None  # no padding: exactly the unpacked computation
    if len(set(frames)) > 1 or len(set(cached)) > 1:
        steps = torch.arange(top, device=x.device)[None] < lengths[:, None]
        held = torch.arange(most, device=x.device)[None] < torch.tensor([c for c in cached for _ in range(2)],
                                                                       device=x.device)[:, None]
        key_mask = torch.cat([steps, held], dim=1)[:, None, None, :]
    h, c = est._inputs(x, mu, t, torch.cat(spks), cond)
    new_cnn, new_att = [], []
    for i, block in enumerate(est.blocks):
        h, cnn_i, att_i = _packed_block(block, h, c, key_mask, cnn[i], att[i], lengths)
        new_cnn.append(cnn_i)
        new_att.append(att_i)
    return est.final_layer(h, c).transpose(1, 2), torch.stack(new_cnn), torch.stack(new_att)


def _packed_block(block: DitBlock, x, c, key_mask, cnn_cache, att_cache, lengths):
    """:meth:`DitBlock.forward` over right-padded rows: the conv histories end at each row's length."""
    (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
     shift_conv, scale_conv, gate_conv) = block.adaLN_modulation(c).chunk(9, dim=-1)
    attn_out, new_att = block.attn(modulate(block.norm1(x), shift_msa, scale_msa), key_mask, att_cache)
    x = x + gate_msa * attn_out
    conv_out, new_cnn = _packed_conv(block.conv.block, modulate(block.norm3(x), shift_conv, scale_conv),
                                     cnn_cache, lengths)
    x = x + gate_conv * conv_out
    x = x + gate_mlp * block.mlp(modulate(block.norm2(x), shift_mlp, scale_mlp))
    return x, new_cnn, new_att


def _packed_conv(layers, x, cache, lengths):
    """CausalConvBlock over (B, T, C) rows; each row's new history is the (kernel - 1) inputs before
    its length, not before the padding."""
    history = CONV_KERNEL - 1
    hist1, hist2 = cache.chunk(2, dim=1)
    in1 = torch.cat([hist1, x.transpose(1, 2)], dim=2)
    h = F.mish(layers["3"](layers["1"](in1).transpose(1, 2))).transpose(1, 2)
    in2 = torch.cat([hist2, h], dim=2)
    out = layers["6"](in2).transpose(1, 2)
    index = (lengths[:, None, None] + torch.arange(history, device=x.device)).expand(-1, in1.shape[1], -1)
    return out, torch.cat([in1.gather(2, index), in2.gather(2, index)], dim=1)


# ----------------------------------------------------------------------------- loading
def load_step_audio2_kind(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                          *, registry: Any = None, max_voices: int = DEFAULT_MAX_VOICES,
                          sine_noise: SineNoiseProvider | None = None) -> StepAudio2Kind:
    """The kind over a Step-Audio-2-mini ``token2wav`` directory (flow in ``dtype``, default fp16 on
    CUDA; HiFT fp32), the first ``max_voices`` voices of ``registry`` (a SpeakerRegistry) warmed."""
    device = torch.device(device)
    models = load_step_audio2(model_dir, device, dtype or default_flow_dtype(device))
    kind = StepAudio2Kind(models, max_voices=max_voices, sine_noise=sine_noise)
    if registry is not None:
        for speaker_id in registry.ids()[:max_voices]:
            kind.prepare_voices([registry.get(speaker_id).features])
    return kind
