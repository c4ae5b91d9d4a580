"""Incremental streaming flow: each chunk computes its new frames, not the whole prefix again.

Upstream (and :meth:`CosyVoice2Flow.inference`) re-runs the flow over prompt + all tokens on
every streaming chunk and drops the frames voiced before. With streaming masks the flow is
chunk-causal, which makes most of that work repeat itself exactly:

* encoder: attention is block-causal over C = 25-token blocks counted from the first prompt
  token (2C-frame blocks after up-sampling); the pre-lookahead conv ties token i to tokens
  i+1..i+3, which a non-final call always has (they are its look-ahead tokens), and every other
  conv is causal;
* estimator: attention is block-causal over E = 50-frame blocks, convs are causal, and the
  initial noise of frame k is fixed (frame k of the fixed buffer).

So once a block is complete (all its positions present), its outputs — mu, and the ODE state of
each Euler step — never change in later re-runs. A block that is still open does change: it is
bidirectional inside. :class:`FlowStream` therefore keeps, per encoder layer, the keys/values
of the committed (complete-block) positions and the left context of each causal conv, and per
Euler step and CFG branch the same for every estimator layer. A chunk recomputes only its
*window*: from the start of the open block of the previous call to the end of the new frames.
Its output equals the full re-run of the prefix with the earlier frames dropped, up to float
rounding (the reference's own behaviour: the re-run revises the open block and drops it again).

Cost model, per chunk of h new tokens (W = window length):
* W ≤ h + C - 1 tokens in the encoder and ≤ 2h + E - 1 frames in the estimator (the open block
  is recomputed: on average ~C/2 tokens / E/2 frames of extra work);
* all projections, FFNs, convs and norms scale with W — flat in the position;
* attention scores cost W x T (T = frames so far), the only part that grows with the position:
  the new frames do attend to everything before them;
* the full re-run costs T (+ T^2 attention) per chunk instead.
Memory held per frame (estimator, dominant): 2 (K, V) x 2 (CFG rows) x steps x transformer
blocks x heads x head_dim values — for the released model 2*2*10*56*512 = 1.15 M values,
2.3 MB in fp16 (4.6 MB fp32) per mel frame, i.e. ~115 MB (fp16) per second of prompt + speech.
This is the price of skipping the recomputation; close streams as soon as they finish.

The final chunk: upstream runs it *non-streaming* (full attention over everything), so it
cannot be incremental; the default final step is that full re-run. ``streaming_final=True``
instead finishes incrementally with streaming masks (no look-ahead held back, zeros after the
last token): cheap, but its last frames equal ``inference(streaming=True, finalize=True)``, not
upstream's non-streaming final chunk.
"""

from __future__ import annotations

import torch

from ...errors import InvalidInputError
from .cache import FrameBuffer, StreamWindow, state_bytes
from .cfm import N_TIMESTEPS, fixed_noise
from .flow import CosyVoice2Flow


class FlowStream:
    """One request's incremental streaming flow (batch 1). Not thread-safe; one step at a time.

    prompt_token (1, P), prompt_feat (1, 2P, 80), embedding (1, 192). Each :meth:`step` takes all
    target tokens so far and returns the mel of the frames not returned before. The final step
    runs non-streaming over everything, like upstream, unless ``streaming_final``. The stream closes itself after
    the final step and when a step fails after validation (its state may be inconsistent).
    """

    def __init__(self, flow: CosyVoice2Flow, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                 embedding: torch.Tensor, *, streaming_final: bool = False, n_timesteps: int = N_TIMESTEPS) -> None:
        flow.check_prompt(prompt_token, prompt_feat, embedding, batch=1)
        weight = flow.spk_embed_affine_layer.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.flow = flow
        self.streaming_final = streaming_final
        self.n_timesteps = n_timesteps
        self._prompt_token = prompt_token.to(self.device, torch.long)
        self._prompt_feat = prompt_feat.to(self.device, self.dtype)
        self._embedding = embedding.to(self.device, self.dtype)
        with torch.inference_mode():
            self._spks = flow.speaker_vector(self._embedding)
        self._target = self._prompt_token[:, :0]  # target tokens received so far
        self._prompt_frames = self._prompt_feat.size(1)
        self._frames_out = self._prompt_frames  # frames (prompt included) returned or prompt
        self._token_commit = 0  # tokens (prompt included) in complete encoder blocks
        self._frame_commit = 0  # frames (prompt included) in complete estimator blocks
        self._encoder_states: dict = {}
        self._step_states: list[dict] = [{} for _ in range(n_timesteps)]
        self._mu = FrameBuffer(dim=2)
        self.closed = False

    @property
    def frames_returned(self) -> int:
        """Target mel frames returned so far (= token_mel_ratio * token_offset in token2wav terms)."""
        return self._frames_out - self._prompt_frames

    @property
    def committed_frames(self) -> int:
        """Frames (prompt included) whose estimator state is final and cached: the next window starts here."""
        return self._frame_commit

    @property
    def state_bytes(self) -> int:
        """Memory held by the cached state."""
        states = [self._encoder_states, *self._step_states]
        return sum(state_bytes(s) for s in states) + self._mu.nbytes

    def close(self) -> None:
        """Drop the cached state (idempotent)."""
        self.closed = True
        self._encoder_states, self._step_states, self._mu = {}, [], FrameBuffer(dim=2)

    @torch.inference_mode()
    def step(self, tokens_so_far: torch.Tensor, finalize: bool) -> torch.Tensor:
        """tokens_so_far (1, n): every target token so far (extending the previous step's).

        Returns the float32 mel (1, 80, f) of the frames not returned before: frames
        [frames_returned, 2(n - 3)) of ``inference(tokens_so_far, streaming=True, finalize=False)``,
        or, when ``finalize``, [frames_returned, 2n) of ``inference(..., streaming=False,
        finalize=True)`` (``streaming=True`` with ``streaming_final``). f must be positive.
        """
        if self.closed:
            raise InvalidInputError("the flow stream is closed (finalized, closed or failed)")
        tokens = self._validated(tokens_so_far, finalize)
        try:
            mel = self._step(tokens, finalize)
        except BaseException:
            self.close()
            raise
        if finalize:
            self.close()
        return mel

    def _validated(self, tokens_so_far: torch.Tensor, finalize: bool) -> torch.Tensor:
        """Check tokens_so_far; return it on the model's device."""
        flow, seen = self.flow, self._target.size(1)
        flow.check_ids("tokens_so_far", tokens_so_far)
        if tokens_so_far.size(0) != 1:
            raise InvalidInputError(f"a flow stream serves one request: tokens_so_far must be (1, n), "
                                    f"got {tuple(tokens_so_far.shape)}")
        flow.check_length(self._prompt_token.size(1), tokens_so_far.size(1), finalize)
        tokens = tokens_so_far.to(self.device, torch.long)
        if tokens.size(1) < seen or not torch.equal(tokens[:, :seen], self._target):
            raise InvalidInputError(f"tokens_so_far must extend the {seen} tokens of the previous step")
        lookahead = 0 if finalize else flow.cfg.pre_lookahead_len
        frames = self._prompt_frames + flow.cfg.token_mel_ratio * (tokens.size(1) - lookahead)
        if frames <= self._frames_out:
            raise InvalidInputError(
                f"{tokens.size(1)} tokens give no frames beyond the {self.frames_returned} already returned"
                + ("" if finalize else f" (the last {lookahead} tokens are look-ahead only)")
            )
        return tokens

    def _step(self, target: torch.Tensor, finalize: bool) -> torch.Tensor:
        flow, cfg = self.flow, self.flow.cfg
        done = self._frames_out - self._prompt_frames
        self._target = target
        if finalize and not self.streaming_final:
            return flow.inference(target, self._prompt_token, self._prompt_feat, self._embedding, streaming=False,
                                  finalize=True, n_timesteps=self.n_timesteps)[:, :, done:]
        ratio = cfg.token_mel_ratio
        tokens = torch.cat([self._prompt_token, target], dim=1)
        valid_tokens = tokens.size(1) - (0 if finalize else cfg.pre_lookahead_len)
        frames = ratio * valid_tokens

        # Encoder window: from the first token of the open block; commit the blocks completed now.
        token_start = self._token_commit
        token_commit = token_start if finalize else _floor_to(valid_tokens, cfg.encoder.static_chunk_size)
        window = StreamWindow(token_start, token_commit - token_start, self._encoder_states)
        encoder_out = flow.encode(tokens[:, token_start:], streaming=True, finalize=finalize, window=window)
        mu = self._mu.extend(flow.project(encoder_out), commit=ratio * (token_commit - token_start))

        # Estimator window: from the first frame of its open block; its committed frames need final mu.
        frame_start = self._frame_commit
        frame_commit = frame_start if finalize else _floor_to(ratio * token_commit, cfg.estimator.static_chunk_size)
        windows = [StreamWindow(frame_start, frame_commit - frame_start, states) for states in self._step_states]
        z = fixed_noise(frames, self.device, self.dtype)[:, :, frame_start:]
        mask = torch.ones(1, 1, frames - frame_start, device=self.device, dtype=self.dtype)
        cond = flow.prompt_condition(self._prompt_feat, frame_start, frames)
        for _, x in flow.decoder.euler_steps(z, mask, mu[:, :, frame_start:], self._spks, cond, streaming=True,
                                             n_timesteps=self.n_timesteps, windows=windows):
            pass
        mel = x[:, :, self._frames_out - frame_start:].float()
        self._token_commit, self._frame_commit, self._frames_out = token_commit, frame_commit, frames
        return mel


def _floor_to(value: int, multiple: int) -> int:
    return value // multiple * multiple
