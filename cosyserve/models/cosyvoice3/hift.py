"""Causal HiFT vocoder of CosyVoice3 (upstream ``CausalHiFTGenerator``): mel (1, 80, M) -> 24 kHz speech.

Same layer names and widths as CosyVoice2's HiFT (:mod:`cosyserve.models.hift`), but every
convolution is one-sided, up-sampling is a nearest-neighbour repeat followed by a plain
convolution, the F0 predictor is causal and runs in float64, and the harmonic phase is
piecewise constant per mel frame. Nothing random is drawn at inference: the additive noise of the
source is upstream's fixed construction-time buffer, which :class:`SourceNoiseBuffer` reproduces.

Look-ahead (fixture README §5.1): the F0 predictor reads 3 mel frames ahead, ``conv_pre`` 4 more,
and the inverse STFT's last frame needs one more: a non-final call (``finalize=False``) returns
480·(M − 8) samples, which later calls on a longer mel reproduce; a final call pads with zeros
and returns 480·M. Because the network is causal, :class:`CausalHiftStream` vocodes only the new
frames of a stream (plus a bounded left context) and carries the F0 look-back, the harmonic
phase and the noise position between calls, instead of re-vocoding the whole mel as the
reference runtime does.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from ...errors import InvalidInputError, ModelLoadError
from ...runtime import host_to_device
from ...schedule import OUTPUT_SAMPLE_RATE
from ..hift.generator import POST_LRELU_SLOPE, ResBlock, spectrum_to_wave, stft_spectrum
from ..hift.loading import _read_state_dict, normalise_hift_keys
from ..flow.cfm import NOISE_CHANNELS, NOISE_FRAMES, NOISE_SEED
from ..hift.source import HarmonicSource
from .config import CausalHiftConfig, config_from_model_dir

WEIGHTS_FILE = "hift.pt"
F0_LOOKAHEAD = 3  # right context of the F0 predictor's first convolution (kernel 4)
F0_LAYERS = 5
F0_LEFT_REACH = 8  # 4 causal kernel-3 convolutions: f0 frame j reads mel frames j-8 .. j+3
# Left context, in mel frames, that a windowed decode needs so that its first emitted sample equals the
# full pass: the decoder's receptive field (a change of the excitation in frame 0 reaches output frame 29,
# one of the mel in frame 0 frame 21) plus margin for the zero/reflect padding at the window start.
STREAM_CONTEXT_FRAMES = 36

# Upstream's construction order before the source noise is drawn (fixture README §5.2): the CFM
# reseeds torch with 0 and draws its noise, the flow builds its token embedding and speaker
# projection, the HiFT its F0 predictor; then SineGen2 draws rand_ini and the noise buffer.
NOISE_SAMPLES = 300 * OUTPUT_SAMPLE_RATE  # upstream's buffer: 300 s at 24 kHz
NOISE_GROWTH = 10 * OUTPUT_SAMPLE_RATE  # the least a device copy of it grows by
# Rows of a batched F0 or decoder call are padded to one of these counts (then to a multiple of the last),
# and its frames to one of these widths (then to a multiple of the last). Why: cuDNN builds its plans for
# each new input shape of each convolution, ~1 ms of host time each (~90 convolutions here), so a batch of
# a row count not seen before cost the loop ~160 ms at once (the fifteenth session: 8 new clips while 16
# streams played, vocoder host time per iteration 4 -> 163 ms), and so would every final chunk of a length
# not seen before (a reply's length sets its last chunk's width). With buckets the shapes are few, and
# warm_up_shapes runs those of replies up to WARM_UP_FRAMES' windows at load.
ROW_BUCKETS = (1, 2, 4, 8, 16)
FRAME_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256)
# The widest window warm_up_shapes runs: a final chunk's decoder window in a reply of up to ~190 tokens
# (7.6 s; the exponential schedule's chunks after the third are 100 tokens). Wider ones, rarer, build
# their plans once when first met.
WARM_UP_FRAMES = 256


class CausalResBlock(ResBlock):
    """CosyVoice2's ResBlock with all its padding moved to the left (zeros before the signal)."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__(channels, kernel_size, dilations)
        for conv in (*self.convs1, *self.convs2):
            conv.padding = (0,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            h = conv1(F.pad(act1(x), (conv1.dilation[0] * (conv1.kernel_size[0] - 1), 0)))
            x = x + conv2(F.pad(act2(h), (conv2.kernel_size[0] - 1, 0)))
        return x


class CausalF0Predictor(nn.Module):
    """Mel (B, 80, M) -> F0 in Hz (B, M or M − 3): weight-normed Conv1d k4 reading 3 frames ahead,
    4 × causal Conv1d k3, ELU after each, Linear, abs (upstream ``CausalConvRNNF0Predictor``)."""

    def __init__(self, in_channels: int, cond_channels: int, num_class: int = 1):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(F0_LAYERS):
            kernel = F0_LOOKAHEAD + 1 if i == 0 else 3
            layers += [weight_norm(nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, kernel)),
                       nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: torch.Tensor, finalize: bool, starts: torch.Tensor | None = None) -> torch.Tensor:
        """``starts`` (B,) int64: each row's first real frame (rows of different lengths left-padded into
        one batch). Every layer's output before it is zeroed, as a row alone would see the causal
        convolutions' zero padding there, so each row's F0 is the one it gets alone."""
        h = F.pad(mel, (0, F0_LOOKAHEAD)) if finalize else mel
        real = None
        if starts is not None:
            real = (torch.arange(h.shape[2] - F0_LOOKAHEAD, device=h.device)[None] >= starts[:, None])[:, None]
        for i in range(0, len(self.condnet), 2):
            conv, act = self.condnet[i], self.condnet[i + 1]
            h = act(conv(h if i == 0 else F.pad(h, (conv.kernel_size[0] - 1, 0))))
            if real is not None:
                h = h * real
        return self.classifier(h.transpose(1, 2)).squeeze(-1).abs()


class SourceNoiseBuffer:
    """The fixed uniform noise of the causal source (upstream ``SineGen2.sine_waves``), drawn lazily.

    Upstream draws ``torch.rand(1, 7_200_000, harmonics)`` from the global CPU generator right after a
    fixed chain of draws (CFM noise, flow embedding and speaker projection, F0 predictor init),
    so the buffer depends on those shapes. We replay that chain on a private generator and draw
    only as many rows as calls need (the CPU generator fills a tensor sequentially, so a prefix
    of the draw is the draw of the prefix), continuing the same generator when more are needed.
    """

    def __init__(self, harmonics: int, f0_in_channels: int, f0_cond_channels: int, *, vocab_size: int = 6561,
                 token_dim: int = 80, spk_embed_dim: int = 192):
        self.harmonics = harmonics
        self._shapes = (f0_in_channels, f0_cond_channels, vocab_size, token_dim, spk_embed_dim)
        self._generator: torch.Generator | None = None  # replayed on first use
        self._rand_ini = torch.empty(0)
        self._rows = torch.empty(1, 0, harmonics)
        self._on_device: dict[torch.device, torch.Tensor] = {}
        self._lock = threading.Lock()

    def _replay(self) -> torch.Generator:
        f0_in, f0_cond, vocab_size, token_dim, spk_embed_dim = self._shapes
        gen = torch.Generator().manual_seed(NOISE_SEED)

        def draw(shape: tuple[int, ...], normal: bool = False) -> None:
            """Advance ``gen`` as an init of a tensor of this shape does (the values are discarded)."""
            if normal:
                torch.empty(shape, device="cpu").normal_(generator=gen)
            else:
                torch.empty(shape, device="cpu").uniform_(generator=gen)

        draw((1, NOISE_CHANNELS, NOISE_FRAMES), normal=True)  # the CFM's noise (same seed as its buffer)
        draw((vocab_size, token_dim), normal=True)  # flow.input_embedding
        for shape in _linear_init_shapes(spk_embed_dim, token_dim):  # flow.spk_embed_affine_layer
            draw(shape)
        for i in range(F0_LAYERS):  # hift.f0_predictor convolutions (weight, bias), then its classifier
            kernel = F0_LOOKAHEAD + 1 if i == 0 else 3
            draw((f0_cond, f0_in if i == 0 else f0_cond, kernel))
            draw((f0_cond,))
        for shape in _linear_init_shapes(f0_cond, 1):
            draw(shape)
        self._rand_ini = torch.rand(1, self.harmonics, generator=gen, device="cpu")
        self._rand_ini[:, 0] = 0
        return gen

    @property
    def rand_ini(self) -> torch.Tensor:
        """Upstream's initial phases (1, harmonics): drawn to advance the generator; they have no
        effect on the output (README §5.2), but reproduce the reference's values."""
        with self._lock:
            if self._generator is None:
                self._generator = self._replay()
            return self._rand_ini

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Noise of absolute output samples [start, stop): (1, stop − start, harmonics), float32 CPU."""
        if stop > NOISE_SAMPLES:
            raise InvalidInputError(f"the causal HiFT's noise covers {NOISE_SAMPLES} samples (300 s); {stop} asked")
        with self._lock:
            return self._drawn(stop)[:, start:stop]

    def samples(self, stop: int, device: torch.device) -> torch.Tensor:
        """The noise of output samples [0, ≥ stop) on ``device`` (1, samples, harmonics) float32.

        On a GPU the copy is kept and grown (doubling, at least 10 s) through pinned memory: a stream's
        chunk reads its rows there. Why: copying each chunk's rows from pageable memory made the host
        wait for the device's whole queue (the flow's steps) once per stream and chunk."""
        if stop > NOISE_SAMPLES:
            raise InvalidInputError(f"the causal HiFT's noise covers {NOISE_SAMPLES} samples (300 s); {stop} asked")
        with self._lock:
            if device.type == "cpu":
                return self._drawn(stop)
            kept = self._on_device.get(device)
            if kept is None or kept.shape[1] < stop:
                grown = min(NOISE_SAMPLES, max(stop, 2 * (0 if kept is None else kept.shape[1]), NOISE_GROWTH))
                kept = host_to_device(self._drawn(grown)[:, :grown], device)
                self._on_device[device] = kept
            return kept

    def _drawn(self, stop: int) -> torch.Tensor:
        """The CPU rows, drawn up to ``stop`` at least (the caller holds the lock)."""
        if self._generator is None:
            self._generator = self._replay()
        if stop > self._rows.shape[1]:
            more = torch.rand(1, stop - self._rows.shape[1], self.harmonics, generator=self._generator, device="cpu")
            self._rows = torch.cat([self._rows, more], dim=1)
        return self._rows


def _linear_init_shapes(in_features: int, out_features: int) -> tuple[tuple[int, ...], ...]:
    return (out_features, in_features), (out_features,)


class CausalHarmonicSource(HarmonicSource):
    """Frame-rate F0 -> excitation (B, 1, 480·T), with the phase carried across calls.

    Upstream (SineGen2, causal) integrates (k·f0/24000 mod 1) at frame rate with a float32 cumsum
    (accumulated in float64 on the CPU, each partial sum rounded), scales by 2π·480 and repeats each
    frame's phase over its 480 samples (nearest up-sampling, unlike CosyVoice2's linear one). We
    keep the float64 running sum, so a stream continues the phase exactly where it stopped.
    """

    def forward(self, f0: torch.Tensor, noise: torch.Tensor,
                phase_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """f0 (B, T) float32; noise (B, 480·T, H) uniform; phase_sum (B, H) float64 running sum of the
        cycles per sample before these frames (None: start of the utterance).
        Returns the excitation (B, 1, 480·T) and the new running sum."""
        f0 = f0.float()
        harmonics = torch.arange(1, self.num_harmonics + 1, dtype=torch.float32, device=f0.device)
        cycles = (f0.unsqueeze(-1) * harmonics / self.sampling_rate) % 1  # (B, T, H)
        if phase_sum is None:
            phase_sum = torch.zeros(f0.shape[0], self.num_harmonics, dtype=torch.float64, device=f0.device)
        sums = phase_sum.unsqueeze(1) + torch.cumsum(cycles.double(), dim=1)
        phase = sums.float() * 2 * math.pi * self.upsample_scale
        scale = self.upsample_scale
        sines = torch.sin(phase).repeat_interleave(scale, dim=1) * self.sine_amp  # (B, 480·T, H)
        voiced = (f0 > self.voiced_threshold).float().repeat_interleave(scale, dim=1).unsqueeze(-1)
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        excitation = sines * voiced + noise_amp * noise.to(f0.device, torch.float32)
        merged = torch.tanh(self.l_linear(excitation.to(self.l_linear.weight.dtype)))
        return merged.transpose(1, 2), (sums[:, -1] if sums.shape[1] else phase_sum)


class CausalHiFTGenerator(nn.Module):
    def __init__(self, cfg: CausalHiftConfig):
        super().__init__()
        self.cfg = cfg
        self.hop_length = cfg.hop_length
        spectrum_channels = cfg.istft_n_fft + 2
        stages = len(cfg.upsample_rates)
        # Registration order = upstream's, so state_dict() lists keys in the same order.
        self.m_source = CausalHarmonicSource(cfg.sampling_rate, self.hop_length, cfg.nb_harmonics, cfg.nsf_alpha,
                                             cfg.nsf_sigma, cfg.nsf_voiced_threshold)
        self.conv_pre = weight_norm(nn.Conv1d(cfg.in_channels, cfg.base_channels, cfg.conv_pre_look_right + 1))
        self.ups = nn.ModuleList(
            weight_norm(nn.Conv1d(cfg.base_channels // 2**i, cfg.base_channels // 2 ** (i + 1), k))
            for i, k in enumerate(cfg.upsample_kernel_sizes))
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (kernel, dilations) in enumerate(zip(cfg.source_resblock_kernel_sizes,
                                                    cfg.source_resblock_dilation_sizes)):
            channels = cfg.base_channels // 2 ** (i + 1)
            stride = math.prod(cfg.upsample_rates[i + 1:])
            self.source_downs.append(nn.Conv1d(spectrum_channels, channels, 1) if stride == 1
                                     else nn.Conv1d(spectrum_channels, channels, 2 * stride, stride))
            self.source_resblocks.append(CausalResBlock(channels, kernel, dilations))
        self.resblocks = nn.ModuleList(
            CausalResBlock(cfg.base_channels // 2 ** (i + 1), k, d)
            for i in range(stages) for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
        self.conv_post = weight_norm(nn.Conv1d(cfg.base_channels // 2**stages, spectrum_channels, 7))
        self.f0_predictor = CausalF0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels, cfg.f0_num_class)
        window = torch.hann_window(cfg.istft_n_fft, periodic=True, dtype=torch.float64).float()
        self.register_buffer("stft_window", window, persistent=False)
        self.noise = SourceNoiseBuffer(self.m_source.num_harmonics, cfg.f0_in_channels, cfg.f0_cond_channels)

    @property
    def lookahead_frames(self) -> int:
        """Mel frames a non-final call holds back: F0 look-ahead, conv_pre look-ahead, the iSTFT tail."""
        return F0_LOOKAHEAD + self.cfg.conv_pre_look_right + 1

    def fold_weight_norm(self) -> "CausalHiFTGenerator":
        """Replace every weight-normalised weight by g·v/‖v‖, computed in each layer's own dtype
        (float64 for the F0 predictor once :meth:`f0_in_float64` ran)."""
        for module in self.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        return self

    def f0_in_float64(self) -> "CausalHiFTGenerator":
        """Upstream runs the F0 predictor (weight norm included) in float64; keep it there."""
        self.f0_predictor.double()
        return self

    # ----- pieces -----

    def predict_f0(self, mel: torch.Tensor, finalize: bool, starts: torch.Tensor | None = None) -> torch.Tensor:
        """mel (B, 80, M) -> F0 (B, M or M − 3) float32, computed in the F0 predictor's dtype (float64).
        ``starts``: rows of different lengths left-padded, each row's first real frame (:class:`CausalF0Predictor`)."""
        dtype = self.f0_predictor.classifier.weight.dtype
        cudnn = torch.backends.cudnn
        with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                         allow_tf32=False):
            return self.f0_predictor(mel.to(dtype), finalize, starts).float()

    def compute_source(self, f0: torch.Tensor, start_frames: int | Sequence[int] = 0,
                       phase_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """F0 (B, T) of frames [start, start + T) of each row's utterance (``start_frames``: one for every
        row, or one per row; a row left-padded with F0 0 starts before frame 0) -> excitation
        (B, 1, 480·T) and the phase sums (B, harmonics) after them (``phase_sum``: before them)."""
        hop, frames = self.hop_length, f0.shape[1]
        starts = [start_frames] * f0.shape[0] if isinstance(start_frames, int) else list(start_frames)
        noise = self.noise.samples((max(starts) + frames) * hop, f0.device)
        if min(starts) == max(starts) >= 0:
            noise = noise[:, starts[0] * hop:(starts[0] + frames) * hop].expand(f0.shape[0], -1, -1)
        else:  # each row's own samples, gathered on the device (a padded row's samples before 0: any)
            first = host_to_device(torch.tensor(starts, dtype=torch.long) * hop, f0.device)
            index = (first[:, None] + torch.arange(frames * hop, device=f0.device)).clamp_(min=0)
            noise = noise[0][index]
        return self.m_source(f0, noise, phase_sum)

    def _stft(self, x: torch.Tensor) -> torch.Tensor:
        return stft_spectrum(x, self.cfg.istft_n_fft, self.cfg.istft_hop_len, self.stft_window)

    def spectrum_columns(self, frames: int, finalize: bool) -> int:
        """Columns of the source spectrum and of the decoder's output for a window of ``frames`` mel
        frames: 120·F' + 1, F' = F (finalize) or F − conv_pre_look_right."""
        kept = frames if finalize else frames - self.cfg.conv_pre_look_right
        return kept * self.hop_length // self.cfg.istft_hop_len + 1

    def source_spectrum(self, source: torch.Tensor, finalize: bool) -> torch.Tensor:
        """Excitation (B, 1, 480·F) -> its STFT (B, 18, :meth:`spectrum_columns`) as the decoder reads it."""
        spec = self._stft(source.squeeze(1))
        return spec[:, :, :self.spectrum_columns(source.shape[2] // self.hop_length, finalize)]

    def predict_spectrum(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool) -> torch.Tensor:
        """Decoder input mel (B, 80, F) + excitation (B, 1, 480·F) -> conv_post output (B, 18, 120·F' + 1),
        F' = F (finalize) or F − conv_pre_look_right."""
        return self.spectrum_from(mel, self.source_spectrum(source, finalize), finalize)

    def spectrum_from(self, mel: torch.Tensor, source_spec: torch.Tensor, finalize: bool) -> torch.Tensor:
        """:meth:`predict_spectrum` given the excitation's :meth:`source_spectrum`. Every layer is causal
        (conv_pre reads its look-ahead from ``mel``), so frames appended after a window's end change
        none of the window's own columns: rows right-padded to a common width get their own values."""
        if finalize:
            mel = F.pad(mel, (0, self.cfg.conv_pre_look_right))
        x = self.conv_pre(mel)
        n_kernels = len(self.cfg.resblock_kernel_sizes)
        for i, (up, rate) in enumerate(zip(self.ups, self.cfg.upsample_rates)):
            x = F.leaky_relu(x, self.cfg.lrelu_slope).repeat_interleave(rate, dim=2)
            x = up(F.pad(x, (up.kernel_size[0] - 1, 0)))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # one more frame: the STFT is centred
            down = self.source_downs[i]
            s = down(F.pad(source_spec, (down.stride[0] - 1, 0)))
            x = x + self.source_resblocks[i](s)
            blocks = self.resblocks[i * n_kernels:(i + 1) * n_kernels]
            x = sum(block(x) for block in blocks) / n_kernels
        x = F.leaky_relu(x, POST_LRELU_SLOPE)
        return self.conv_post(F.pad(x, (self.conv_post.kernel_size[0] - 1, 0)))

    def spectrum_to_wave(self, spectrum: torch.Tensor, finalize: bool) -> torch.Tensor:
        """conv_post output -> speech (B, 4·(frames − 1)), minus the last 480 samples unless finalizing."""
        wave = spectrum_to_wave(spectrum, self.cfg.istft_n_fft, self.cfg.istft_hop_len, self.stft_window,
                                self.cfg.audio_limit)
        return wave if finalize else wave[:, :wave.shape[1] - self.hop_length]

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool) -> torch.Tensor:
        """Decoder input mel (B, 80, F) + excitation (B, 1, 480·F) -> speech (B, 480·F) or (B, 480·(F − 5))."""
        return self.spectrum_to_wave(self.predict_spectrum(mel, source, finalize), finalize)

    # ----- whole calls -----

    @torch.inference_mode()
    def inference(self, mel: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Upstream's call on a whole mel (1, 80, M) from the utterance start: (speech, excitation).
        speech has 480·M samples (finalize) or 480·(M − 8)."""
        self._check_mel(mel, 1 if finalize else self.lookahead_frames + 1)
        mel = mel.to(self.conv_pre.weight.device, torch.float32)
        f0 = self.predict_f0(mel, finalize)
        source, _ = self.compute_source(f0)
        return self.decode(mel[:, :, :f0.shape[1]], source, finalize), source

    def _check_mel(self, mel: torch.Tensor, min_frames: int) -> None:
        if mel.dim() != 3 or mel.shape[0] != 1 or mel.shape[1] != self.cfg.in_channels or mel.shape[2] < min_frames:
            raise InvalidInputError(
                f"the causal HiFT expects a mel of shape (1, {self.cfg.in_channels}, M ≥ {min_frames}), "
                f"got {tuple(mel.shape)}")


@dataclass
class CausalHiftCall:
    """One stream's decoder work for a push: its mel window (1, 80, F) and excitation (1, 1, 480·F)
    (None: nothing to decode), and which of the decoded samples are new."""

    mel: torch.Tensor | None
    source: torch.Tensor | None
    finalize: bool
    skip: int  # decoded samples before the new ones (the window's left context)
    samples: int  # new samples


class HiftNetwork(Protocol):
    """What runs the causal HiFT's two convolution stacks for :func:`push_streams`: the vocoder itself
    (eager), or its CUDA graphs at the padded shapes (:class:`~cosyserve.token2wav.graphs.CausalHiftGraphs`)."""

    def predict_f0(self, mel: torch.Tensor, finalize: bool, starts: torch.Tensor | None = None) -> torch.Tensor: ...

    def spectrum_from(self, mel: torch.Tensor, source_spec: torch.Tensor, finalize: bool) -> torch.Tensor: ...


@torch.inference_mode()
def prepare_calls(items: list[tuple["CausalHiftStream", torch.Tensor, bool]],
                  net: HiftNetwork | None = None) -> list[CausalHiftCall]:
    """:meth:`CausalHiftStream.push` up to the decoder, for many streams of one vocoder: every (stream,
    new mel frames (1, 80, n), finalize)'s new F0 in one float64 call and its excitation in one call,
    the rows of different lengths left-padded (each row gets the values it gets alone). Why: stream by stream it
    was ~50 operator calls a stream and chunk (a CPU profile of 16 streams' call: 1,962 top-level
    operators, 1,132 batched), on the loop's thread, which measured ~165 ms of host time an iteration
    at 16 CosyVoice3 streams. Every stream is checked before any changes. ``net``: what runs the F0
    predictor (the streams' vocoder by default)."""
    for stream, mel, _ in items:
        if stream.finished:
            raise InvalidInputError("this vocoder stream is finished")
        stream.hift._check_mel(mel, 0)
    if len({id(stream.hift) for stream, _, _ in items}) > 1:
        raise ValueError("prepare_calls takes streams of one vocoder")
    due = [(stream, stream._append(mel, finalize)) for stream, mel, finalize in items]
    due = [(stream, f0_end) for stream, f0_end in due if f0_end is not None]
    if due:
        _excite(due, net or due[0][0].hift)
    return [stream._decoder_call() for stream, _, _ in items]


def _excite(due: list[tuple["CausalHiftStream", int]], net: HiftNetwork) -> None:
    """Each (stream, end)'s F0 and excitation of frames [stream.f0_frames, end), rows batched."""
    hift = due[0][0].hift
    hop, device = hift.hop_length, due[0][0].mel.device
    windows = [stream._f0_window() for stream, _ in due]
    width = bucket_frames(max(w.shape[2] for w in windows))
    mel = _stack_padded(windows, width, left=True)
    if all(w.shape[2] == width for w in windows):
        f0 = net.predict_f0(mel, False)
    else:  # rows left-padded to the width bucket; padding rows: all padding
        pads = [width - w.shape[2] for w in windows] + [width] * (mel.shape[0] - len(windows))
        f0 = net.predict_f0(mel, False, host_to_device(torch.tensor(pads, dtype=torch.long), device))
    f0 = f0[:len(due)]
    # every row's last column is its frame end - 1; its new frames are its last ones, the columns before
    # them get F0 0 (no phase, so the phase sums carry over exactly)
    new = [end - stream.f0_frames for stream, end in due]
    frames = max(new)
    f0 = f0[:, f0.shape[1] - frames:]
    if min(new) < frames:
        first = host_to_device(torch.tensor([frames - n for n in new], dtype=torch.long), device)
        f0 = f0 * (torch.arange(frames, device=device)[None] >= first[:, None])
    harmonics = hift.m_source.num_harmonics
    phase = torch.cat([stream.phase_sum if stream.phase_sum is not None else
                       torch.zeros(1, harmonics, dtype=torch.float64, device=device) for stream, _ in due])
    source, sums = hift.compute_source(f0, [stream.f0_frames - (frames - n) for (stream, _), n in zip(due, new)],
                                       phase)
    for row, ((stream, end), n) in enumerate(zip(due, new)):
        stream.source = torch.cat([stream.source, source[row:row + 1, :, (frames - n) * hop:]], dim=2)
        stream.phase_sum = sums[row:row + 1]
        stream.f0_frames = end


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for bucket in buckets:
        if n <= bucket:
            return bucket
    return -(-n // buckets[-1]) * buckets[-1]


def bucket_rows(rows: int) -> int:
    """The row count a batched call of ``rows`` rows is padded to (:data:`ROW_BUCKETS`)."""
    return _bucket(rows, ROW_BUCKETS)


def bucket_frames(frames: int) -> int:
    """The width a batched call's windows of up to ``frames`` mel frames are padded to (:data:`FRAME_BUCKETS`)."""
    return _bucket(frames, FRAME_BUCKETS)


@torch.inference_mode()
def decode_calls(hift: "CausalHiFTGenerator", calls: list[CausalHiftCall],
                 net: HiftNetwork | None = None) -> list[torch.Tensor | None]:
    """Every call's decoded window, calls of one padded shape (:func:`bucket_frames` of their frames,
    finalize) in one batched decoder call, rows right-padded with zero frames and zero rows added up to
    :func:`bucket_rows`. Each row's output is the one it gets alone: its excitation's spectrum is taken
    at its own length, the network is causal (:meth:`CausalHiFTGenerator.spectrum_from`), and its
    columns are cut back to its own before the inverse STFT. ``net``: what runs the decoder network
    (``hift`` by default)."""
    net = net or hift
    out: list[torch.Tensor | None] = [None] * len(calls)
    live = [i for i, call in enumerate(calls) if call.mel is not None]
    for (width, finalize), members in _groups(
            live, lambda i: (bucket_frames(calls[i].mel.shape[2]), calls[i].finalize)).items():
        # rows of one width together (the usual batch: streams at one point of the schedule, one group)
        same_width = _groups(members, lambda i: calls[i].mel.shape[2])
        mels = [torch.cat([calls[i].mel for i in same]) for same in same_width.values()]
        specs = [hift.source_spectrum(torch.cat([calls[i].source for i in same]), finalize)
                 for same in same_width.values()]
        spectrum = net.spectrum_from(_stack_padded(mels, width),
                                      _stack_padded(specs, hift.spectrum_columns(width, finalize)), finalize)
        first = 0
        for frames, same in same_width.items():
            columns = hift.spectrum_columns(frames, finalize)
            speech = hift.spectrum_to_wave(spectrum[first:first + len(same), :, :columns], finalize)
            for row, i in enumerate(same):
                out[i] = speech[row:row + 1]
            first += len(same)
    return out


def _groups(indices: list[int], key) -> dict:
    groups: dict = {}
    for i in indices:
        groups.setdefault(key(i), []).append(i)
    return groups


def _stack_padded(tensors: list[torch.Tensor], width: int, left: bool = False) -> torch.Tensor:
    """(b, C, w) tensors -> (bucket_rows(Σb), C, width): their rows in order, each padded with zeros on
    the right (or the left), zero rows after them; tensors of one width (the usual case) in two operators."""
    count = sum(t.shape[0] for t in tensors)
    rows = bucket_rows(count)
    if len({t.shape[2] for t in tensors}) == 1:
        x = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
        pad = width - x.shape[2]
        return F.pad(x, ((pad, 0) if left else (0, pad)) + (0, 0, 0, rows - count))
    stacked = tensors[0].new_zeros(rows, tensors[0].shape[1], width)
    first = 0
    for t in tensors:
        columns = slice(width - t.shape[2], width) if left else slice(0, t.shape[2])
        stacked[first:first + t.shape[0], :, columns] = t
        first += t.shape[0]
    return stacked


def push_streams(items: list[tuple["CausalHiftStream", torch.Tensor, bool]],
                 net: HiftNetwork | None = None) -> list[torch.Tensor]:
    """:meth:`CausalHiftStream.push` of many streams of one vocoder at once: (stream, new mel frames,
    finalize) -> each stream's new samples (1, s), prepared (:func:`prepare_calls`) and decoded
    (:func:`decode_calls`) together, the convolution stacks run by ``net`` (the vocoder by default)."""
    if not items:
        return []
    calls = prepare_calls(items, net)
    return [stream.complete(call, window)
            for (stream, _, _), call, window in zip(items, calls, decode_calls(items[0][0].hift, calls, net))]


def batched_shapes(max_rows: int, max_frames: int = WARM_UP_FRAMES) -> list[tuple[int, int]]:
    """The (rows, frames) of every batched F0 and decoder call of up to ``max_rows`` rows and windows of
    up to ``max_frames`` frames: each row bucket at each frame bucket (:data:`ROW_BUCKETS`,
    :data:`FRAME_BUCKETS`)."""
    rows_buckets = sorted({bucket_rows(n) for n in range(1, max_rows + 1)})
    return list(product(rows_buckets, [w for w in FRAME_BUCKETS if w <= bucket_frames(max_frames)]))


@torch.inference_mode()
def warm_up_shapes(hift: "CausalHiFTGenerator", max_rows: int, max_frames: int = WARM_UP_FRAMES) -> None:
    """Run every :func:`batched_shapes` call once (the decoder's final and non-final ones), so that
    serving builds no cuDNN plan for them."""
    device, channels = hift.conv_pre.weight.device, hift.cfg.in_channels
    for rows, width in batched_shapes(max_rows, max_frames):
        hift.predict_f0(torch.zeros(rows, channels, width, device=device), False)
        for finalize in (False, True):
            call = CausalHiftCall(torch.zeros(1, channels, width, device=device),
                                  torch.zeros(1, 1, width * hift.hop_length, device=device), finalize, 0, 0)
            decode_calls(hift, [call] * rows)


class CausalHiftStream:
    """One utterance vocoded chunk by chunk: each :meth:`push` runs the vocoder only over the new mel
    frames plus ``STREAM_CONTEXT_FRAMES`` of left context, and returns only new samples.

    The concatenated output equals upstream's re-vocode-everything composition (and one final call
    on the whole mel) to float rounding: F0 of a frame is computed once, from its own 8 frames of
    look-back and 3 of look-ahead; the harmonic phase continues from its running sum; the noise is
    read at absolute sample positions; the decoder's context covers its receptive field.
    """

    def __init__(self, hift: CausalHiFTGenerator, context_frames: int = STREAM_CONTEXT_FRAMES):
        self.hift = hift
        self.context = context_frames
        device = hift.conv_pre.weight.device
        self.mel = torch.empty(1, hift.cfg.in_channels, 0, device=device)  # frames [mel_start, frames)
        self.mel_start = 0
        self.frames = 0
        self.f0_frames = 0  # frames whose F0 and excitation are known (final)
        self.source = torch.empty(1, 1, 0, device=device)  # excitation of frames [source_start, f0_frames)
        self.source_start = 0
        self.phase_sum: torch.Tensor | None = None
        self.emitted = 0  # samples returned so far
        self.finished = False

    @torch.inference_mode()
    def push(self, mel: torch.Tensor, finalize: bool = False) -> torch.Tensor:
        """Append mel frames (1, 80, n) (n may be 0 on the last call) and return the new samples (1, s)."""
        return push_streams([(self, mel, finalize)])[0]

    def _append(self, mel: torch.Tensor, finalize: bool) -> int | None:
        """Take the new mel frames; the end of the frames whose F0 is now known, if it moved."""
        self.mel = torch.cat([self.mel, mel.to(self.mel.device, torch.float32)], dim=2)
        self.frames += mel.shape[2]
        self.finished = finalize
        f0_end = self.frames if finalize else self.frames - F0_LOOKAHEAD
        return f0_end if f0_end > self.f0_frames else None

    def _f0_window(self) -> torch.Tensor:
        """The mel the F0 of the frames after :attr:`f0_frames` reads (1, 80, L): their look-back, and
        zeros after the last frame when finished."""
        window = self._mel(max(0, self.f0_frames - F0_LEFT_REACH), self.frames)
        return F.pad(window, (0, F0_LOOKAHEAD)) if self.finished else window

    def _decoder_call(self) -> "CausalHiftCall":
        """The decoder's window after the excitation is known (nothing to decode: mel None)."""
        hop = self.hift.hop_length
        speech_end = hop * (self.frames if self.finished else self.frames - self.hift.lookahead_frames)
        if speech_end <= self.emitted:
            return CausalHiftCall(None, None, self.finished, 0, 0)
        start = max(0, self.emitted // hop - self.context)
        call = CausalHiftCall(self._mel(start, self.f0_frames), self.source[:, :, (start - self.source_start) * hop:],
                              self.finished, self.emitted - start * hop, speech_end - self.emitted)
        self.emitted = speech_end
        return call

    def complete(self, call: "CausalHiftCall", speech: torch.Tensor | None) -> torch.Tensor:
        """The new samples (1, s) of a prepared call, given its window's decoded ``speech`` (1, S)."""
        if call.mel is None:
            return self.mel.new_zeros(1, 0)
        self._trim()
        return speech[:, call.skip:call.skip + call.samples]

    def _mel(self, start: int, stop: int) -> torch.Tensor:
        return self.mel[:, :, start - self.mel_start:stop - self.mel_start]

    def _trim(self) -> None:
        """Drop the frames no later call reads: before the next decode window and the F0 look-back."""
        next_window = max(0, self.emitted // self.hift.hop_length - self.context)
        keep_mel = min(next_window, max(0, self.f0_frames - F0_LEFT_REACH))
        self.mel = self.mel[:, :, keep_mel - self.mel_start:]
        self.mel_start = keep_mel
        self.source = self.source[:, :, (next_window - self.source_start) * self.hift.hop_length:]
        self.source_start = next_window


def load_causal_hift(model_dir: str | Path, device: torch.device | str = "cpu", *,
                     config: CausalHiftConfig | None = None, weights: str | Path | None = None,
                     fold_weight_norm: bool = True) -> CausalHiFTGenerator:
    """Build the vocoder from ``model_dir/cosyvoice3.yaml`` (or ``config``; released values when
    neither) and strictly load ``model_dir/hift.pt`` (or ``weights``; ``generator.`` prefixes and
    old weight-norm key spellings accepted). The network is float32, the F0 predictor float64."""
    model_dir = Path(model_dir)
    config = config or config_from_model_dir(model_dir, CausalHiftConfig)
    path = Path(weights) if weights is not None else model_dir / WEIGHTS_FILE
    if not path.is_file():
        raise ModelLoadError(f"causal HiFT checkpoint {path} not found")
    model = CausalHiFTGenerator(config)
    try:
        model.load_state_dict(normalise_hift_keys(_read_state_dict(path)), strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"{path} does not match the causal HiFT config {config}: {exc}") from exc
    model.f0_in_float64()
    if fold_weight_norm:
        model.fold_weight_norm()
    return model.to(device).eval().requires_grad_(False)
