"""Resampling and the three spectral front-ends of CosyVoice2, in plain torch (no torchaudio).

Each function reproduces one reference recipe (fixture README §7) and is checked against the
recorded outputs by the ``cv2_frontend`` parity suite:

* :func:`resample` - ``torchaudio.transforms.Resample`` defaults (Hann-windowed sinc).
* :func:`matcha_mel_spectrogram` - the 24 kHz, 80-bin prompt mel that conditions the flow.
* :func:`kaldi_fbank` / :func:`campplus_features` - the CAM++ speaker-encoder input.
* :func:`whisper_log_mel` - the 128-bin log-mel read by the S3 speech tokenizer.

Everything is vectorised (framing by ``unfold``/``stft``, filters as matrices) because these
run per request on the server CPU. Outputs are float32 on the input's device. Filter banks
and windows are cached per (parameters, device); callers must not modify them in place.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from ..schedule import OUTPUT_SAMPLE_RATE

# The rate of the prompt audio the speech tokenizer (Whisper log-mel) and CAM++ (Kaldi fbank) take.
TOKENIZER_SAMPLE_RATE = 16000

# --- resampling ------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _sinc_resample_kernel(
    orig: int, new: int, lowpass_filter_width: int, rolloff: float, device: torch.device
) -> tuple[torch.Tensor, int]:
    """Polyphase kernel (new, 1, 2*width + orig) for the reduced ratio ``orig -> new``.

    Output phase j of each block of ``new`` samples is the band-limited interpolation of the
    input at time j/new (in input samples), low-passed at ``rolloff * min(orig, new)``.
    Computed in float64, used in float32, like torchaudio.
    """
    base_freq = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base_freq)
    taps = torch.arange(-width, width + orig, dtype=torch.float64) / orig
    phases = -torch.arange(new, dtype=torch.float64)[:, None] / new
    t = ((phases + taps) * base_freq).clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t)
    kernel = sinc * window * (base_freq / orig)
    return kernel[:, None, :].to(device=device, dtype=torch.float32), width


def resample(wav: torch.Tensor, orig_freq: int, new_freq: int, *,
             lowpass_filter_width: int = 6, rolloff: float = 0.99) -> torch.Tensor:
    """Resample ``(..., N)`` from ``orig_freq`` to ``new_freq`` Hz -> ``(..., ceil(N*new/orig))``.

    Matches ``torchaudio.functional.resample`` with its defaults (``sinc_interp_hann``): zero
    padding at both ends, then the polyphase kernel over strided blocks of the input, as one matrix
    product (the strided convolution it equals would, on a GPU, have cuDNN plan every new length).
    """
    if orig_freq <= 0 or new_freq <= 0 or int(orig_freq) != orig_freq or int(new_freq) != new_freq:
        raise ValueError(f"sample rates must be positive integers, got {orig_freq} -> {new_freq}")
    wav = wav.to(torch.float32)
    if orig_freq == new_freq:
        return wav
    gcd = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // gcd, int(new_freq) // gcd
    kernel, width = _sinc_resample_kernel(orig, new, lowpass_filter_width, float(rolloff), wav.device)
    lead_shape, length = wav.shape[:-1], wav.shape[-1]
    flat = F.pad(wav.reshape(-1, length), (width, width + orig))
    blocks = flat.unfold(-1, kernel.size(-1), orig)  # (B, blocks, taps)
    out = (blocks @ kernel[:, 0].T).reshape(flat.shape[0], -1)  # phase j of block b at b * new + j
    target_length = -(-new * length // orig)  # ceil without float rounding
    return out[:, :target_length].reshape(*lead_shape, -1)


# --- mel filter banks -----------------------------------------------------------------

# Slaney mel scale (librosa's default, htk=False): linear below 1 kHz, logarithmic above.
_SLANEY_HZ_PER_MEL = 200.0 / 3
_SLANEY_MIN_LOG_HZ = 1000.0
_SLANEY_MIN_LOG_MEL = _SLANEY_MIN_LOG_HZ / _SLANEY_HZ_PER_MEL
_SLANEY_LOGSTEP = math.log(6.4) / 27.0


def _hz_to_slaney_mel(hz: torch.Tensor) -> torch.Tensor:
    linear = hz / _SLANEY_HZ_PER_MEL
    log_part = _SLANEY_MIN_LOG_MEL + torch.log(hz.clamp(min=_SLANEY_MIN_LOG_HZ) / _SLANEY_MIN_LOG_HZ) / _SLANEY_LOGSTEP
    return torch.where(hz >= _SLANEY_MIN_LOG_HZ, log_part, linear)


def _slaney_mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    linear = mel * _SLANEY_HZ_PER_MEL
    log_part = _SLANEY_MIN_LOG_HZ * torch.exp(_SLANEY_LOGSTEP * (mel - _SLANEY_MIN_LOG_MEL))
    return torch.where(mel >= _SLANEY_MIN_LOG_MEL, log_part, linear)


@lru_cache(maxsize=8)
def _slaney_mel_filters_cpu(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> torch.Tensor:
    f64 = torch.float64
    fft_freqs = torch.arange(n_fft // 2 + 1, dtype=f64) * (1.0 / (n_fft * (1.0 / sample_rate)))
    mel_edges = torch.linspace(float(_hz_to_slaney_mel(torch.tensor(fmin, dtype=f64))),
                               float(_hz_to_slaney_mel(torch.tensor(fmax, dtype=f64))), n_mels + 2, dtype=f64)
    hz_edges = _slaney_mel_to_hz(mel_edges)
    widths = hz_edges.diff()
    ramps = hz_edges[:, None] - fft_freqs[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    # librosa rounds the triangles to float32 before applying the area normalisation in float64.
    triangles = torch.minimum(rising, falling).clamp(min=0).to(torch.float32).to(f64)
    area_norm = 2.0 / (hz_edges[2:] - hz_edges[:-2])
    return (triangles * area_norm[:, None]).to(torch.float32)


def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                       fmax: float | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """librosa ``filters.mel(sr, n_fft, n_mels, fmin, fmax)`` (Slaney scale and area norm).

    Returns float32 ``(n_mels, n_fft // 2 + 1)``. Used by both the Matcha 24 kHz mel and the
    Whisper/S3-tokenizer log-mel (whose stored filters were made by the same function).
    """
    fmax = sample_rate / 2.0 if fmax is None else float(fmax)
    return _slaney_mel_filters_on(int(sample_rate), int(n_fft), int(n_mels), float(fmin), fmax, torch.device(device))


@lru_cache(maxsize=16)
def _slaney_mel_filters_on(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float,
                           device: torch.device) -> torch.Tensor:
    """Kept per device: a copy from the host inside a CUDA graph capture is not allowed (and each
    call would otherwise copy them again)."""
    return _slaney_mel_filters_cpu(sample_rate, n_fft, n_mels, fmin, fmax).to(device)


def _kaldi_mel(hz: torch.Tensor) -> torch.Tensor:
    return 1127.0 * torch.log1p(hz / 700.0)


@lru_cache(maxsize=8)
def _kaldi_mel_banks_cpu(num_bins: int, padded_window: int, sample_rate: float,
                         low_freq: float, high_freq: float) -> torch.Tensor:
    f64 = torch.float64
    mel_low, mel_high = (float(_kaldi_mel(torch.tensor(f, dtype=f64))) for f in (low_freq, high_freq))
    mel_delta = (mel_high - mel_low) / (num_bins + 1)
    left = mel_low + torch.arange(num_bins, dtype=f64)[:, None] * mel_delta
    center, right = left + mel_delta, left + 2 * mel_delta
    bin_mel = _kaldi_mel(torch.arange(padded_window // 2, dtype=f64) * (sample_rate / padded_window))[None, :]
    up = (bin_mel - left) / (center - left)
    down = (right - bin_mel) / (right - center)
    banks = torch.minimum(up, down).clamp(min=0)
    # Kaldi has no weight on the Nyquist bin: one zero column to match the rfft size.
    return F.pad(banks, (0, 1)).to(torch.float32)


def kaldi_mel_banks(num_bins: int, padded_window: int, sample_rate: float, low_freq: float = 20.0,
                    high_freq: float = 0.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Kaldi triangular filters on the 1127·ln(1 + f/700) scale -> ``(num_bins, padded_window//2 + 1)``.

    ``high_freq <= 0`` is an offset from Nyquist, as in Kaldi. No VTLN warping.
    """
    nyquist = 0.5 * sample_rate
    high = high_freq + nyquist if high_freq <= 0 else high_freq
    if not 0.0 <= low_freq < high <= nyquist:
        raise ValueError(f"bad mel band edges low={low_freq} high={high} for sample rate {sample_rate}")
    return _kaldi_mel_banks_on(int(num_bins), int(padded_window), float(sample_rate), float(low_freq), float(high),
                               torch.device(device))


@lru_cache(maxsize=16)
def _kaldi_mel_banks_on(num_bins: int, padded_window: int, sample_rate: float, low_freq: float, high_freq: float,
                        device: torch.device) -> torch.Tensor:
    return _kaldi_mel_banks_cpu(num_bins, padded_window, sample_rate, low_freq, high_freq).to(device)


@lru_cache(maxsize=8)
def _window(kind: str, length: int, device: torch.device) -> torch.Tensor:
    if kind == "hann":  # periodic, as torch.hann_window's default
        return torch.hann_window(length, dtype=torch.float32, device=device)
    if kind == "povey":  # Kaldi: symmetric Hann raised to 0.85
        return torch.hann_window(length, periodic=False, dtype=torch.float32, device=device).pow(0.85)
    raise ValueError(f"unknown window {kind!r}")


# --- Matcha 24 kHz mel (flow prompt features) --------------------------------------------


def matcha_mel_spectrogram(wav: torch.Tensor, *, n_fft: int = 1920, num_mels: int = 80,
                           sample_rate: int = OUTPUT_SAMPLE_RATE, hop_size: int = 480, win_size: int = 1920,
                           fmin: float = 0.0, fmax: float | None = 8000.0, min_frames: int = 0) -> torch.Tensor:
    """Matcha-TTS ``mel_spectrogram(..., center=False)``: ``(..., N)`` -> ``(..., num_mels, N // hop)``.

    Reflect-pad (n_fft - hop)/2 on both sides, uncentred STFT with a periodic Hann window,
    magnitude sqrt(re² + im² + 1e-9), Slaney mel filters, natural log after clamping at 1e-5.
    The defaults are CosyVoice2's prompt-mel settings (24 kHz, 80 bins, 20 ms hop). Unlike
    upstream, the filter cache is keyed by every parameter. ``min_frames``: the STFT runs over at
    least this many frames (zeros after the padded signal; the frames returned are the same): on a
    GPU each new frame count is a new FFT plan, so callers round it up to a few lengths.
    """
    wav = wav.to(torch.float32)
    pad = (n_fft - hop_size) // 2
    if wav.shape[-1] <= pad:
        raise ValueError(f"waveform of {wav.shape[-1]} samples is too short for the mel (needs > {pad})")
    lead_shape = wav.shape[:-1]
    flat = F.pad(wav.reshape(-1, 1, wav.shape[-1]), (pad, pad), mode="reflect").squeeze(1)
    frames = (flat.shape[-1] - n_fft) // hop_size + 1
    if min_frames > frames:
        flat = F.pad(flat, (0, (min_frames - frames) * hop_size))
    spec = torch.stft(flat, n_fft, hop_length=hop_size, win_length=win_size,
                      window=_window("hann", win_size, wav.device), center=False, return_complex=True)
    magnitude = torch.sqrt(torch.view_as_real(spec[..., :frames]).pow(2).sum(-1) + 1e-9)
    filters = slaney_mel_filters(sample_rate, n_fft, num_mels, fmin, fmax, device=wav.device)
    mel = torch.log(torch.clamp(filters @ magnitude, min=1e-5))
    return mel.reshape(*lead_shape, num_mels, -1)


# --- Kaldi fbank (CAM++ input) ----------------------------------------------------------


def kaldi_frame_count(n_samples: torch.Tensor | int, sample_frequency: float = float(TOKENIZER_SAMPLE_RATE),
                      frame_length_ms: float = 25.0, frame_shift_ms: float = 10.0):
    """Whole Kaldi frames in ``n_samples`` samples: 1 + (N - win) // shift, 0 when N < win."""
    win = int(sample_frequency * frame_length_ms * 0.001)
    shift = int(sample_frequency * frame_shift_ms * 0.001)
    if isinstance(n_samples, torch.Tensor):
        return torch.where(n_samples < win, 0, 1 + (n_samples - win).clamp(min=0) // shift)
    return 0 if n_samples < win else 1 + (n_samples - win) // shift


def kaldi_fbank(wav: torch.Tensor, *, num_mel_bins: int = 80, sample_frequency: float = float(TOKENIZER_SAMPLE_RATE),
                frame_length_ms: float = 25.0, frame_shift_ms: float = 10.0,
                preemphasis: float = 0.97, low_freq: float = 20.0, high_freq: float = 0.0,
                batched: bool = False) -> torch.Tensor:
    """``torchaudio.compliance.kaldi.fbank(wav, num_mel_bins, dither=0, sample_frequency)``.

    Input ``(N,)`` or ``(1, N)`` float waveform in [-1, 1] (no int16 scaling); output
    ``(frames, num_mel_bins)`` with frames = 1 + (N - win) // shift (whole frames only; zero
    frames when N < win). Per frame: DC removal, pre-emphasis (first sample is its own
    predecessor), Povey window, zero-pad to a power of two, power spectrum, mel banks,
    natural log floored at float32 eps. ``batched``: ``wav`` is ``(B, N)``, clips zero-padded at
    the end, output ``(B, frames of N, bins)``; every frame lies inside its clip, so clip b's first
    :func:`kaldi_frame_count` frames are those of the clip alone and the rest are padding.
    """
    if wav.dim() == 2 and not batched:
        wav = wav[0]  # torchaudio reads channel 0
    wav = wav.to(torch.float32)
    win = int(sample_frequency * frame_length_ms * 0.001)
    shift = int(sample_frequency * frame_shift_ms * 0.001)
    padded = 1 << (win - 1).bit_length()
    if wav.shape[-1] < win:
        return wav.new_zeros(*wav.shape[:-1], 0, num_mel_bins)
    frames = wav.unfold(-1, win, shift)  # (..., frames, win), a view: no copy
    frames = frames - frames.mean(dim=-1, keepdim=True)
    previous = torch.cat([frames[..., :1], frames[..., :-1]], dim=-1)
    frames = (frames - preemphasis * previous) * _window("povey", win, wav.device)
    power = torch.fft.rfft(F.pad(frames, (0, padded - win))).abs().pow(2)
    banks = kaldi_mel_banks(num_mel_bins, padded, sample_frequency, low_freq, high_freq, device=wav.device)
    energies = power @ banks.T
    return energies.clamp(min=torch.finfo(torch.float32).eps).log()


def campplus_features(wav16: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """CAM++ input: 80-bin Kaldi fbank of 16 kHz audio minus its per-bin mean -> ``(1, frames, 80)``.

    ``lengths``: ``wav16`` is a zero-padded batch ``(B, N)`` of clips of ``lengths`` samples ->
    ``(B, frames, 80)``, each clip normalised by the mean over its own frames, padding frames 0.
    """
    if lengths is None:
        fbank = kaldi_fbank(wav16, num_mel_bins=80, sample_frequency=float(TOKENIZER_SAMPLE_RATE))
        return (fbank - fbank.mean(dim=0, keepdim=True)).unsqueeze(0)
    fbank = kaldi_fbank(wav16, num_mel_bins=80, sample_frequency=float(TOKENIZER_SAMPLE_RATE), batched=True)
    counts = kaldi_frame_count(lengths.to(fbank.device))
    inside = (torch.arange(fbank.shape[1], device=fbank.device)[None, :] < counts[:, None])[..., None]
    mean = torch.where(inside, fbank, 0.0).sum(dim=1, keepdim=True) / counts.clamp(min=1)[:, None, None]
    return torch.where(inside, fbank - mean, 0.0)


# --- Whisper log-mel (S3 speech tokenizer input) ----------------------------------------

WHISPER_N_FFT = 400
WHISPER_HOP = 160


def _reflect_pad_each(wav: torch.Tensor, lengths: torch.Tensor, pad: int) -> torch.Tensor:
    """``(B, N)`` zero-padded clips -> ``(B, N + 2*pad)``, each reflect-padded at its own ends."""
    index = torch.arange(-pad, wav.shape[-1] + pad, device=wav.device)[None, :].expand(wav.shape[0], -1)
    last = (lengths.to(wav.device) - 1)[:, None]
    index = index.abs()  # reflection at the start
    index = torch.where(index > last, 2 * last - index, index)  # reflection at each clip's end
    return wav.gather(1, index.clamp(min=0))


def whisper_log_mel(wav16: torch.Tensor, n_mels: int = 128, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """``whisper.log_mel_spectrogram(wav, n_mels)``: ``(..., N)`` -> ``(..., n_mels, N // 160)``.

    Centred STFT (reflect padding, periodic Hann 400, hop 160) with its last frame dropped,
    power spectrum, Slaney mel filters (sr 16 kHz, n_fft 400), log10 after clamping at 1e-10,
    floor at (max - 8) over the WHOLE tensor (all batch items), then (x + 4) / 4.
    ``lengths``: ``wav16`` is a zero-padded batch ``(B, N)`` of clips of ``lengths`` samples (each
    longer than 200, unchecked here); each clip is reflect-padded at its own end and floored at its
    own maximum, so clip b's first ``lengths[b] // 160`` frames equal the clip's log-mel alone
    (later frames are padding).
    """
    wav16 = wav16.to(torch.float32)
    # (a batch's clips are checked by its caller: reading device lengths back would wait for the GPU)
    if lengths is None and wav16.shape[-1] <= WHISPER_N_FFT // 2:
        raise ValueError(f"waveform of {wav16.shape[-1]} samples is too short for the log-mel "
                         f"(needs > {WHISPER_N_FFT // 2})")
    lead_shape = wav16.shape[:-1]
    flat = wav16.reshape(-1, wav16.shape[-1])
    flat_lengths = torch.full((flat.shape[0],), flat.shape[-1]) if lengths is None else lengths
    spec = torch.stft(_reflect_pad_each(flat, flat_lengths, WHISPER_N_FFT // 2), WHISPER_N_FFT, WHISPER_HOP,
                      window=_window("hann", WHISPER_N_FFT, wav16.device), center=False, return_complex=True)
    power = spec[..., :-1].abs() ** 2
    filters = slaney_mel_filters(TOKENIZER_SAMPLE_RATE, WHISPER_N_FFT, n_mels, device=wav16.device)
    log_spec = torch.clamp(filters @ power, min=1e-10).log10()
    if lengths is None:
        floor = log_spec.max()
    else:
        frames = (lengths.to(wav16.device) // WHISPER_HOP)[:, None, None]
        inside = torch.arange(log_spec.shape[-1], device=wav16.device)[None, None, :] < frames
        floor = torch.where(inside, log_spec, -torch.inf).amax(dim=(1, 2), keepdim=True)
    log_spec = torch.maximum(log_spec, floor - 8.0)
    return ((log_spec + 4.0) / 4.0).reshape(*lead_shape, n_mels, -1)
