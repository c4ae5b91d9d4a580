"""Runs the model on the slot cache: prefill, bucketed decode, sampling, CUDA graphs on GPU.

Decode inputs live in static per-slot buffers (``input_ids``, ``positions``) that the decode step
itself advances, so a graph replay needs no host-to-device copy; the host only reads back the
sampled tokens. Decode graphs exist per (batch bucket, KV-length bucket): rows beyond the running
requests belong to free slots and compute harmless garbage.

Prefill replays a graph per (new-token bucket, KV-length bucket) that also samples the first token,
one replay per request admitted, their first tokens read back together. An eager padded batch would
take less device time, but it is hundreds of launches, each needing the GIL that the engine's loop
holds most of the time: 8 requests arriving together waited ~30 ms each for their prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...runtime import device_to_host, host_to_device, role_stream
from ..layers.attention import DecodeMetadata, PrefillMetadata, decode_bias
from ..layers.fused import fused_decode_available
from ..models.config import Qwen2Config
from ..models.loader import load_model
from ..prompt import layout_for_vocab_size
from ..sampling import Sampler
from .kv_cache import KVCache

# The CUDA stream role (runtime.role_stream) of the LLM: its graphs are captured on it, its thread runs on it.
LLM_ROLE = "llm"


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
                 max_model_len: int, use_cuda_graphs: bool, fused_decode: bool | None = None):
        """``fused_decode``: decode with the fused kernels of :mod:`..layers.fused`; default where
        they run as Triton kernels (CUDA, bf16/fp16)."""
        self.device, self.dtype = device, dtype
        self.config = Qwen2Config.from_model_dir(model_dir)
        self.layout = layout_for_vocab_size(self.config.vocab_size)
        self.window_start = self.layout.speech_token_offset  # window index + this = the token id fed back
        self.model = load_model(model_dir, device, dtype, max_model_len, self.config)
        self.model.fused_decode = fused_decode_available(device, dtype) if fused_decode is None else fused_decode
        self.kv = KVCache(self.config, max_slots, max_model_len, device, dtype)
        self.sampler = Sampler(max_slots, device, self.layout.output_window_size)
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_slots, **long)
        self.positions = torch.zeros(max_slots, **long)
        self.out_tokens = torch.zeros(max_slots, **long)
        self.rows = torch.arange(max_slots, **long)
        # Lone-request prefill graph inputs: token ids / positions / write slots, and slot / last / length.
        self.prefill_tokens = torch.zeros(3, max_model_len, **long)
        self.prefill_request = torch.zeros(3, **long)
        self.batch_buckets = batch_buckets(max_slots)
        self.length_buckets = length_buckets(max_model_len)
        self.prefill_buckets = length_buckets(max_model_len, smallest=16)
        self.decode_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        if use_cuda_graphs:
            self._capture_graphs()

    # ---- prefill -------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem]) -> list[int]:
        """Cache the KV of each item's new tokens, sample its first token (window index) and make
        that token the slot's next decode input."""
        if self.prefill_graphs:
            for item in items:
                self._replay_prefill(item)
            slots = host_to_device([item.slot for item in items], self.device)
            return device_to_host(self.out_tokens.index_select(0, slots)).tolist()
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

    def prefill_step(self, seq_len: int, kv_len: int) -> None:
        """Graph body: prefill the request described by the static prefill buffers, sample its first token."""
        ids, positions, write_slots = self.prefill_tokens[:, :seq_len]
        slot, last, length = self.prefill_request[0:1], self.prefill_request[1:2], self.prefill_request[2:3]
        mask = (torch.arange(kv_len, device=self.device) <= positions[:, None])[None, None]
        meta = PrefillMetadata(write_slots, positions, slot, mask, num_seqs=1, seq_len=seq_len)
        hidden = self.model(ids, positions, self.kv, meta)
        tokens = self.sampler.sample(self.model.logits(hidden.index_select(0, last)), slot)
        self.out_tokens.index_copy_(0, slot, tokens)
        self.input_ids.index_copy_(0, slot, tokens + self.window_start)
        self.positions.index_copy_(0, slot, length)

    def _replay_prefill(self, item: PrefillItem) -> None:
        """Launch the item's prefill graph; its first token lands in ``out_tokens[item.slot]``. The
        inputs are copied without waiting (pageable memory is staged at the call), in stream order
        behind the previous item's replay, which reads the same buffers."""
        new = len(item.ids) - item.start
        seq_len = _bucket(self.prefill_buckets, new)
        host = torch.empty(3, seq_len, dtype=torch.long)
        host[0].zero_()
        host[0, :new] = torch.tensor(item.ids[item.start:])
        torch.clamp(torch.arange(seq_len) + item.start, max=self.kv.max_len - 1, out=host[1])
        host[2].fill_(self.kv.spare_slot)
        host[2, :new] = item.slot
        self.prefill_tokens[:, :seq_len].copy_(host, non_blocking=True)
        self.prefill_request.copy_(torch.tensor([item.slot, new - 1, len(item.ids)]), non_blocking=True)
        self.prefill_graphs[(seq_len, _bucket(self.length_buckets, len(item.ids)))].replay()

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
        """Graph body: one token for slots 0..batch-1 (no host sync)."""
        tokens = self.sampler.sample(self._decode_logits(batch, kv_len), self.rows[:batch])
        self.out_tokens[:batch] = tokens
        self.input_ids[:batch] = tokens + self.window_start
        # Free rows keep counting; the clamp keeps their (ignored) writes inside the cache.
        self.positions[:batch] = (self.positions[:batch] + 1).clamp_(max=self.kv.max_len - 1)

    def graph_shape(self, num_rows: int, max_position: int) -> tuple[int, int]:
        """(batch bucket, length bucket) of a decode step: the key of its CUDA graph."""
        return _bucket(self.batch_buckets, num_rows), _bucket(self.length_buckets, max_position + 1)

    @torch.inference_mode()
    def decode(self, num_rows: int, max_position: int) -> list[int]:
        """Sample the next token of slots 0..num_rows-1 (window indices)."""
        shape = self.graph_shape(num_rows, max_position)
        graph = self.decode_graphs.get(shape)
        if graph is not None:
            graph.replay()
        else:
            self.decode_step(*shape)
        return device_to_host(self.out_tokens[:num_rows]).tolist()

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
        shapes = [(self.prefill_graphs, self.prefill_step, (seq_len, kv_len))
                  for seq_len in self.prefill_buckets for kv_len in self.length_buckets if kv_len >= seq_len]
        shapes += [(self.decode_graphs, self.decode_step, (batch, kv_len))
                   for batch in self.batch_buckets for kv_len in self.length_buckets]
        pool = None
        # Largest first, so smaller graphs fit in the memory the pool already holds.
        for graphs, step, shape in sorted(shapes, key=lambda entry: entry[2][0] * entry[2][1], reverse=True):
            step(*shape)  # warm-up: loads kernels, picks GEMM algorithms
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=role_stream(self.device, LLM_ROLE)):
                step(*shape)
            pool = pool or graph.pool()
            graphs[shape] = graph
        self.positions.zero_()

    # ---- slot management ---------------------------------------------------------------
    @torch.inference_mode()
    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.kv.move(src, dst, length)
        self.sampler.move(src, dst)
        for buffer in (self.input_ids, self.positions):
            buffer[dst] = buffer[src]
