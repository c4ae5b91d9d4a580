"""Runs the model on the slot cache: prefill, bucketed decode, sampling, CUDA graphs on GPU.

Decode inputs live in static per-slot buffers (``input_ids``, ``positions``) that the decode step
itself advances, so a graph replay needs no host-to-device copy; the host only reads back the
sampled tokens. Decode graphs exist per (batch bucket, KV-length bucket): rows beyond the running
requests belong to free slots and compute harmless garbage. A replay may run several decode steps
(``steps_per_replay``), each feeding its sampled tokens to the next on the device: the thread that
steps the engine then waits for the device, reads tokens back and takes the GIL once per that many
tokens (beside a busy token2wav loop, each of those costs ~2 ms of waiting for the GIL, about what
a decode step costs on the device). A row's tokens after its stop are computed and dropped.

Prefill replays a graph per (rows, new-token bucket, KV-length bucket) that also samples each row's
first token: the requests admitted together are one padded batch of up to :data:`PREFILL_ROWS`'s
largest rows per replay (rows past them read and write the spare slot), their first tokens read back
together. An eager padded batch is hundreds of launches, each needing the GIL that the engine's loop
holds most of the time (8 requests arriving together waited ~30 ms each for their prefill); a replay
per request serialises them on the device (on an H100, 8 prompts of new voices: ~5 ms each, ~40 ms
until the last first token), where one replay of 8 rows reads the weights once.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ...runtime import HIGH_PRIORITY, device_to_host, host_to_device, role_stream
from ..layers.attention import DecodeMetadata, PrefillMetadata, decode_bias
from ..layers.fused import fused_decode_available
from ..models.config import Qwen2Config
from ..models.loader import load_model
from ..prompt import layout_for_vocab_size
from ..sampling import Sampler, SamplingParams
from .kv_cache import KVCache

log = logging.getLogger(__name__)

# The CUDA stream role (runtime.role_stream) of the LLM: its graphs are captured on it, its thread runs on it.
LLM_ROLE = "llm"
# Rows of the captured prefill graphs, and the most padded tokens (rows x new-token bucket) of one.
PREFILL_ROWS = (1, 2, 4, 8)
MAX_PREFILL_GRAPH_TOKENS = 4096
MAX_STEPS_PER_REPLAY = 8


@dataclass
class PrefillItem:
    slot: int
    ids: list[int]  # the whole prompt
    start: int  # ids[:start] already have KV in the slot (prefix cache)


def batch_buckets(max_slots: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_slots]
    return small + list(range(16, max_slots, 8)) + [max_slots]


def length_buckets(max_len: int, smallest: int = 128) -> list[int]:
    buckets = []
    size = smallest
    while size < max_len:
        buckets.append(size)
        size *= 2
    return buckets + [max_len]


def _bucket(buckets: list[int], value: int) -> int:
    return next(b for b in buckets if b >= value)


class ModelRunner:
    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype, max_slots: int,
                 max_model_len: int, use_cuda_graphs: bool, fused_decode: bool | None = None,
                 high_priority: bool = False, steps_per_replay: int = 1):
        """``fused_decode``: decode with the fused kernels of :mod:`..layers.fused`; default where
        they run as Triton kernels (CUDA, bf16/fp16). ``high_priority``: the steps' CUDA stream
        (:attr:`stream_role`) is of the highest priority, so its kernels go before the flow's.
        ``steps_per_replay``: decode steps per :meth:`decode` (one graph)."""
        if not 1 <= steps_per_replay <= MAX_STEPS_PER_REPLAY:
            raise ValueError(f"steps_per_replay must be 1..{MAX_STEPS_PER_REPLAY}, got {steps_per_replay}")
        self.device, self.dtype = device, dtype
        self.steps_per_replay = steps_per_replay
        self.stream_role = LLM_ROLE + HIGH_PRIORITY if high_priority else LLM_ROLE
        self.config = Qwen2Config.from_model_dir(model_dir)
        self.layout = layout_for_vocab_size(self.config.vocab_size)
        self.window_start = self.layout.speech_token_offset  # window index + this = the token id fed back
        self.model = load_model(model_dir, device, dtype, max_model_len, self.config)
        self.model.fused_decode = fused_decode_available(device, dtype) if fused_decode is None else fused_decode
        self.kv = KVCache(self.config, max_slots, max_model_len, device, dtype)
        # Per-slot state has a row for the spare slot too: a prefill graph's padding rows sample there.
        self.sampler = Sampler(max_slots + 1, device, self.layout.output_window_size)
        self.sampler.set_requests([self.kv.spare_slot], [SamplingParams.greedy()], [0], [[]])
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_slots + 1, **long)
        self.positions = torch.zeros(max_slots + 1, **long)
        self.out_tokens = torch.zeros(steps_per_replay, max_slots + 1, **long)  # a replay's tokens, step by step
        self.rows = torch.arange(max_slots, **long)
        # Prefill graph inputs: token ids / positions / write slots of rows x new tokens (row-major),
        # and each row's slot / last token's index / prompt length.
        self.prefill_rows = tuple(rows for rows in PREFILL_ROWS if rows == 1 or rows <= max_slots)
        self.prefill_tokens = torch.zeros(3, self.prefill_rows[-1] * max_model_len, **long)
        self.prefill_request = torch.zeros(3, self.prefill_rows[-1], **long)
        self.batch_buckets = batch_buckets(max_slots)
        self.length_buckets = length_buckets(max_model_len)
        self.prefill_buckets = length_buckets(max_model_len, smallest=16)
        self.decode_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        if use_cuda_graphs:
            self._capture_graphs()

    # ---- prefill -------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem]) -> list[int]:
        """Cache the KV of each item's new tokens, sample its first token (window index) and make
        that token the slot's next decode input."""
        if self.prefill_graphs:
            for group in self._prefill_groups(items):
                self._replay_prefill(group)
            slots = host_to_device([item.slot for item in items], self.device)
            return device_to_host(self.out_tokens[0].index_select(0, slots)).tolist()
        slots = [item.slot for item in items]
        index = torch.tensor(slots, device=self.device)
        tokens = self.sampler.sample(self.prefill_logits(items), index)
        self.input_ids[index] = tokens + self.window_start
        self.positions[index] = torch.tensor([len(item.ids) for item in items], device=self.device)
        return device_to_host(tokens).tolist()

    @torch.inference_mode()
    def prefill_logits(self, items: list[PrefillItem]) -> torch.Tensor:
        """Eager padded-batch prefill; logits of each item's last token (N, window)."""
        num_seqs = len(items)
        lengths = [len(item.ids) - item.start for item in items]
        seq_len = max(lengths)
        ids = torch.zeros(num_seqs, seq_len, dtype=torch.long)
        write_slots = torch.full((num_seqs, seq_len), self.kv.spare_slot, dtype=torch.long)
        starts = torch.tensor([item.start for item in items])
        positions = (starts[:, None] + torch.arange(seq_len)).clamp_(max=self.kv.max_len - 1)
        for row, (item, length) in enumerate(zip(items, lengths)):
            ids[row, :length] = torch.tensor(item.ids[item.start:])
            write_slots[row, :length] = item.slot
        to_device = dict(device=self.device, non_blocking=True)
        mask = None
        if any(item.start for item in items):
            kv_len = max(len(item.ids) for item in items)
            mask = (torch.arange(kv_len)[None, None, :] <= positions[:, :, None]).unsqueeze(1).to(**to_device)
        meta = PrefillMetadata(
            slot_ids=write_slots.flatten().to(**to_device),
            positions=positions.flatten().to(**to_device),
            read_slots=torch.tensor([item.slot for item in items]).to(**to_device),
            mask=mask,
            num_seqs=num_seqs,
            seq_len=seq_len,
        )
        hidden = self.model(ids.flatten().to(**to_device), meta.positions, self.kv, meta)
        last = torch.tensor(lengths) - 1 + torch.arange(num_seqs) * seq_len
        return self.model.logits(hidden[last.to(**to_device)])

    def prefill_shapes(self) -> list[tuple[int, int, int]]:
        """(rows, new-token bucket, KV-length bucket) of every prefill graph."""
        return [(rows, seq_len, kv_len) for rows in self.prefill_rows for seq_len in self.prefill_buckets
                for kv_len in self.length_buckets
                if kv_len >= seq_len and (rows == 1 or rows * seq_len <= MAX_PREFILL_GRAPH_TOKENS)]

    def prefill_step(self, rows: int, seq_len: int, kv_len: int) -> None:
        """Graph body: prefill the rows described by the static prefill buffers, sample each row's first token."""
        ids, positions, write_slots = self.prefill_tokens[:, :rows * seq_len]
        slots, last, length = self.prefill_request[:, :rows]
        mask = (torch.arange(kv_len, device=self.device) <= positions.view(rows, seq_len, 1)).unsqueeze(1)
        meta = PrefillMetadata(write_slots, positions, slots, mask, num_seqs=rows, seq_len=seq_len)
        hidden = self.model(ids, positions, self.kv, meta)
        tokens = self.sampler.sample(self.model.logits(hidden.index_select(0, last)), slots)
        self.out_tokens[0].index_copy_(0, slots, tokens)
        self.input_ids.index_copy_(0, slots, tokens + self.window_start)
        self.positions.index_copy_(0, slots, length)

    def _graph_key(self, items: list[PrefillItem]) -> tuple[int, int, int] | None:
        rows = next((r for r in self.prefill_rows if r >= len(items)), None)
        if rows is None:
            return None
        return (rows, _bucket(self.prefill_buckets, max(len(item.ids) - item.start for item in items)),
                _bucket(self.length_buckets, max(len(item.ids) for item in items)))

    def _prefill_groups(self, items: list[PrefillItem]) -> list[list[PrefillItem]]:
        """``items`` in order, cut into the largest runs that one captured graph takes."""
        groups: list[list[PrefillItem]] = []
        for item in items:
            if groups and self._graph_key(groups[-1] + [item]) in self.prefill_graphs:
                groups[-1].append(item)
            else:
                groups.append([item])
        return groups

    def _replay_prefill(self, items: list[PrefillItem]) -> None:
        """Launch the prefill graph of ``items``; each first token lands in ``out_tokens[item.slot]``.
        Rows past the items are padding that reads and writes the spare slot. The inputs are copied
        without waiting (pageable memory is staged at the call), in stream order behind the previous
        replay, which reads the same buffers."""
        rows, seq_len, kv_len = key = self._graph_key(items)
        spare = self.kv.spare_slot
        host = torch.empty(3, rows, seq_len, dtype=torch.long)
        host[0].zero_()
        host[2].fill_(spare)
        request = torch.tensor([[spare] * rows, [row * seq_len for row in range(rows)], [0] * rows])
        for row, item in enumerate(items):
            new = len(item.ids) - item.start
            host[0, row, :new] = torch.tensor(item.ids[item.start:])
            host[2, row, :new] = item.slot
            request[:, row] = torch.tensor([item.slot, row * seq_len + new - 1, len(item.ids)])
        starts = torch.tensor([item.start for item in items] + [0] * (rows - len(items)))
        torch.clamp(starts[:, None] + torch.arange(seq_len), max=self.kv.max_len - 1, out=host[1])
        self.prefill_tokens[:, :rows * seq_len].copy_(host.view(3, -1), non_blocking=True)
        self.prefill_request[:, :rows].copy_(request, non_blocking=True)
        self.prefill_graphs[key].replay()

    @torch.inference_mode()
    def compute_prefix_kv(self, ids: list[int]) -> torch.Tensor:
        """KV of ``ids`` at positions 0..len-1, computed in the spare slot."""
        self.prefill_logits([PrefillItem(self.kv.spare_slot, ids, 0)])
        return self.kv.read(self.kv.spare_slot, len(ids))

    @torch.inference_mode()
    def load_prefix(self, slot: int, kv: torch.Tensor, length: int) -> None:
        self.kv.write(slot, kv, length)

    # ---- decode --------------------------------------------------------------------------
    def _decode_logits(self, batch: int, kv_len: int) -> torch.Tensor:
        ids, positions = self.input_ids[:batch], self.positions[:batch]
        bias = None if self.model.fused_decode else decode_bias(positions, kv_len, self.config.num_kv_heads, self.dtype)
        meta = DecodeMetadata(self.rows[:batch], positions, kv_len, bias)
        return self.model.logits(self.model(ids, positions, self.kv, meta))

    def decode_step(self, batch: int, kv_len: int) -> None:
        """Graph body: :attr:`steps_per_replay` tokens for slots 0..batch-1, each step's in its row of
        ``out_tokens`` (no host sync)."""
        for step in range(self.steps_per_replay):
            tokens = self.sampler.sample(self._decode_logits(batch, kv_len), self.rows[:batch])
            self.out_tokens[step, :batch] = tokens
            self.input_ids[:batch] = tokens + self.window_start
            # Free rows (and rows past their stop) keep counting; the clamp keeps their (ignored)
            # writes inside the cache.
            self.positions[:batch] = (self.positions[:batch] + 1).clamp_(max=self.kv.max_len - 1)

    def graph_shape(self, num_rows: int, max_position: int) -> tuple[int, int]:
        """(batch bucket, length bucket) of a decode replay from ``max_position``: the key of its CUDA
        graph (the length bucket holds the positions of all its steps)."""
        last = min(max_position + self.steps_per_replay, self.kv.max_len)
        return _bucket(self.batch_buckets, num_rows), _bucket(self.length_buckets, last)

    @torch.inference_mode()
    def decode(self, num_rows: int, max_position: int) -> list[list[int]]:
        """Sample the next :attr:`steps_per_replay` tokens of slots 0..num_rows-1 (window indices):
        one list per step, a token per slot."""
        shape = self.graph_shape(num_rows, max_position)
        graph = self.decode_graphs.get(shape)
        if graph is not None:
            graph.replay()
        else:
            self.decode_step(*shape)
        return device_to_host(self.out_tokens[:, :num_rows]).tolist()

    @torch.inference_mode()
    def decode_logits(self, num_rows: int, max_position: int) -> torch.Tensor:
        """Logits of the current decode inputs of slots 0..num_rows-1, without sampling (eager)."""
        return self._decode_logits(*self.graph_shape(num_rows, max_position))[:num_rows]

    @torch.inference_mode()
    def set_decode_input(self, slot: int, token: int, position: int) -> None:
        """Make window index ``token`` at ``position`` the next decode input of ``slot``."""
        self.input_ids[slot] = token + self.window_start
        self.positions[slot] = position

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        shapes = [("prefill", self.prefill_graphs, self.prefill_step, shape) for shape in self.prefill_shapes()]
        shapes += [("decode", self.decode_graphs, self.decode_step, (batch, kv_len))
                   for batch in self.batch_buckets for kv_len in self.length_buckets]
        pool, seconds = None, {"prefill": 0.0, "decode": 0.0}
        # Largest first, so smaller graphs fit in the memory the pool already holds.
        for kind, graphs, step, shape in sorted(shapes, key=lambda entry: math.prod(entry[3]), reverse=True):
            began = time.perf_counter()
            step(*shape)  # warm-up: loads kernels, picks GEMM algorithms
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=role_stream(self.device, self.stream_role)):
                step(*shape)
            pool = pool or graph.pool()
            graphs[shape] = graph
            seconds[kind] += time.perf_counter() - began
        self.positions.zero_()
        log.info("LLM CUDA graphs captured: %d prefill in %.1f s, %d decode in %.1f s", len(self.prefill_graphs),
                 seconds["prefill"], len(self.decode_graphs), seconds["decode"])

    # ---- slot management ---------------------------------------------------------------
    @torch.inference_mode()
    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.kv.move(src, dst, length)
        self.sampler.move(src, dst)
        for buffer in (self.input_ids, self.positions):
            buffer[dst] = buffer[src]
