"""Per-request sampling parameters and the batched sampler over the speech output window.

The sampler works on float32 logits of the layout's output window, shape ``(rows, window)``
(speech tokens 0..6560, then the stop classes: CosyVoice2's three eos ids, CosyVoice3's 200
classes 6561..6760; ``min_tokens`` masks all of them) and keeps every request's state in per-slot tensors, so one decode step samples
all rows with a fixed sequence of tensor ops (CUDA-graph capturable, no host sync).

Randomness is counter-based: the noise for (request seed, generated-token index, vocabulary
entry) is a hash of those three numbers, so a seeded request draws the same tokens whatever
else is in its batch. Tokens are drawn with the Gumbel-max trick: the argmax of
``logit / temperature + gumbel`` over the allowed set is a sample of the renormalised softmax.

Repetition-aware sampling (RAS, CosyVoice ``ras_sampling``): draw from the top-k/top-p nucleus;
if that token occurs at least ``window * tau`` times among the last ``window`` generated tokens,
draw again from the full distribution.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError
from ..runtime import host_to_device
from .prompt import MAX_SPEECH_TOKENS, NUM_SPEECH_TOKENS, OUTPUT_WINDOW_SIZE

MAX_RAS_WINDOW = 64
_NO_EOS_BEFORE = 1 << 62  # min_tokens value that means "eos never allowed" (ignore_eos)
_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingParams:
    """How one request samples. ``temperature=0`` is greedy (no RAS, no noise)."""

    temperature: float = 1.0
    top_k: int = 25  # 0 = no top-k limit
    top_p: float = 0.8
    repetition_penalty: float = 1.0
    seed: int | None = None  # None: a random seed is drawn when the request is submitted
    ras: bool = True
    ras_window: int = 10
    ras_tau: float = 0.1
    min_tokens: int = 0  # eos is impossible before this many tokens
    max_tokens: int = MAX_SPEECH_TOKENS
    ignore_eos: bool = False  # never stop on eos: generate exactly max_tokens (benchmarks)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def greedy(cls, **overrides) -> "SamplingParams":
        return cls(**{"temperature": 0.0, **overrides})

    def validate(self) -> None:
        def fail(message: str):
            raise InvalidInputError(message)

        def real(name: str, value) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                fail(f"{name} must be a finite number, got {value!r}")
            return float(value)

        def integer(name: str, value) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                fail(f"{name} must be an integer, got {value!r}")
            return value

        if real("temperature", self.temperature) < 0:
            fail(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < real("top_p", self.top_p) <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if integer("top_k", self.top_k) < 0:
            fail(f"top_k must be >= 0 (0 = no limit), got {self.top_k}")
        if real("repetition_penalty", self.repetition_penalty) <= 0:
            fail(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= integer("seed", self.seed) < 2**63:
            fail(f"seed must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.ras, bool) or not isinstance(self.ignore_eos, bool):
            fail("ras and ignore_eos must be booleans")
        if not 1 <= integer("ras_window", self.ras_window) <= MAX_RAS_WINDOW:
            fail(f"ras_window must be in 1..{MAX_RAS_WINDOW}, got {self.ras_window}")
        if not 0 < real("ras_tau", self.ras_tau) <= 1:
            fail(f"ras_tau must be in (0, 1], got {self.ras_tau}")
        if integer("max_tokens", self.max_tokens) <= 0:
            fail(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= integer("min_tokens", self.min_tokens) <= self.max_tokens:
            fail(f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")


# The reference BLS's request to TensorRT-LLM (llm_layout.md §4); TRT-LLM has no RAS.
REFERENCE_SAMPLING = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1,
                                    seed=42, ras=False)
# CosyVoice3's (the reference's trtllm-serve requests): the same, without a seed
COSYVOICE3_SAMPLING = dataclasses.replace(REFERENCE_SAMPLING, seed=None)


def random_seed() -> int:
    return secrets.randbits(63)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xor-shift / multiply) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


class Sampler:
    """Sampling state of ``num_slots`` requests and the batched draw."""

    # Per-slot parameters, packed so that a step gathers them with two index ops:
    # fparams = temperature, top_p, repetition penalty, RAS threshold (window * tau);
    # iparams = top_k, seed key (hash of the seed), min_tokens, RAS window (0 = off), tokens generated.
    I_GENERATED = 4

    def __init__(self, num_slots: int, device: torch.device, vocab: int = OUTPUT_WINDOW_SIZE):
        self.vocab = vocab
        self.fparams = torch.zeros(num_slots, 4, device=device)
        self.iparams = torch.zeros(num_slots, 5, dtype=torch.long, device=device)
        self.presence = torch.zeros(num_slots, vocab, dtype=torch.bool, device=device)
        self.recent = torch.full((num_slots, MAX_RAS_WINDOW), -1, dtype=torch.long, device=device)
        self._columns = torch.arange(vocab, device=device)
        self._window_columns = torch.arange(MAX_RAS_WINDOW, device=device)
        self._is_eos = self._columns >= NUM_SPEECH_TOKENS
        # Two noise streams (nucleus draw, RAS fallback draw) per vocabulary entry.
        self._counters = _hash32(torch.arange(2 * vocab, device=device).view(2, vocab) + 0x9E3779B9)
        self._true = torch.ones((), dtype=torch.bool, device=device)

    def set_requests(self, slots: list[int], params: list[SamplingParams], seeds: list[int],
                     prompt_window_ids: list[list[int]]) -> None:
        """Load requests' parameters into ``slots`` (one copy per state tensor for the whole list);
        ``prompt_window_ids`` (prompt speech tokens) count as seen for the repetition penalty."""
        # host values through pinned memory (host_to_device): a pageable copy would make the LLM's
        # thread wait for its stream's queued decode steps at every admission
        device = self.fparams.device
        index = host_to_device(slots, device, torch.long)
        self.fparams[index] = host_to_device(
            [[p.temperature, p.top_p, p.repetition_penalty, p.ras_window * p.ras_tau] for p in params],
            device, torch.float32)
        seeds = torch.tensor(seeds, dtype=torch.long)
        seed_keys = _hash32((seeds & _MASK32) ^ _hash32((seeds >> 32) ^ 0x85EBCA6B))
        self.iparams[index] = host_to_device(
            [[p.top_k or self.vocab, key, _NO_EOS_BEFORE if p.ignore_eos else p.min_tokens,
              p.ras_window if p.ras and p.temperature > 0 else 0, 0] for p, key in zip(params, seed_keys.tolist())],
            device, torch.long)
        # fills with scalars as kernel arguments: ``state[index] = value`` copies the value to the device
        # as a pageable one-element tensor, a wait for the queue like the copies above
        self.presence.index_fill_(0, index, False)
        rows = [slot for slot, ids in zip(slots, prompt_window_ids) for _ in ids]
        if rows:
            seen = host_to_device([rows, [t for ids in prompt_window_ids for t in ids]], device, torch.long)
            self.presence.index_put_((seen[0], seen[1]), self._true)
        self.recent.index_fill_(0, index, -1)

    def move(self, src: int, dst: int) -> None:
        for state in (self.fparams, self.iparams, self.presence, self.recent):
            state[dst] = state[src]

    def _gumbel(self, seed_key: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """(rows, 2, vocab) Gumbel noise, a pure function of (seed, step, stream, entry)."""
        key = _hash32(seed_key ^ ((step * 0x9E3779B9) & _MASK32))
        bits = _hash32(key[:, None, None] ^ self._counters[None])
        uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))
        return -torch.log(-torch.log(uniform))

    def sample(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Draw one token (window index) per row and record it in the rows' slots."""
        fp, ip = self.fparams[slots], self.iparams[slots]
        temperature, top_p, penalty, ras_threshold = fp.unbind(1)
        top_k, seed_key, min_tokens, ras_window, generated = ip.unbind(1)
        presence, recent = self.presence[slots], self.recent[slots]

        penalised = torch.where(logits > 0, logits / penalty[:, None], logits * penalty[:, None])
        logits = torch.where(presence, penalised, logits)
        logits = logits.masked_fill((generated < min_tokens)[:, None] & self._is_eos, float("-inf"))
        greedy = temperature == 0
        scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]

        # Nucleus: entry i (by descending prob) is kept while i < top_k and the mass before it < top_p.
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep_sorted = (self._columns < top_k[:, None]) & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1))
        keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)

        noise = self._gumbel(seed_key, generated)
        nucleus = torch.where(keep, scaled + noise[:, 0], float("-inf")).argmax(dim=-1)
        full = (scaled + noise[:, 1]).argmax(dim=-1)
        in_window = self._window_columns >= MAX_RAS_WINDOW - ras_window[:, None]
        repeats = ((recent == nucleus[:, None]) & in_window).sum(dim=-1)
        use_full = (ras_window > 0) & (repeats >= ras_threshold)
        tokens = torch.where(greedy, scaled.argmax(dim=-1), torch.where(use_full, full, nucleus))

        self.presence.index_put_((slots, tokens), self._true.expand(tokens.shape))
        self.recent[slots] = torch.cat([recent[:, 1:], tokens[:, None]], dim=1)
        self.iparams[:, self.I_GENERATED][slots] = generated + 1  # a view: one index_put, no host scalar
        return tokens
