"""New voices' first prompt pieces through the flow encoder and its projection in a few launches.

A voice's first prompt piece (up to :data:`~.flow_engine.PREFIX_FIRST_PIECE_TOKENS` tokens, no cached
state) is the longest host work of its preparation: the encoder eagerly is ~320 operators for one voice
(~350 for eight), each launched by the preparation thread while it shares the GIL with the engine's
loop and the LLM, so that a new voice's first chunk waited for that launch and every other stream's
launches slowed with it. :class:`PrefixEncoder` runs them padded to fixed shapes (rows to one of
:data:`~.step_graphs.PREFIX_PAIRS`, tokens to a multiple of a bucket) and, on a GPU, replays a CUDA
graph of each shape, captured at load: a call is then a few copies, one replay and one clone.

The graph's outputs (the mel condition mu and what the rows' encoder state keeps: every causal
convolution's padded input, every attention layer's keys and values) are one flat buffer, cloned out
once per call; each voice's state holds views of its own rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from ..models.flow import CosyVoice2Flow
from ..models.flow.config import UP_STRIDE
from ..models.flow.packed_encoder import encode_first_windows, keep_first_states
from ..runtime import LOOP_ROLE, bucket, host_to_device
from .graphs import GraphCache


class PrefixEncoder:
    """mu of first prompt pieces (tokens 0..n of new voices' prompts, the last ``pre_lookahead_len`` of
    them look-ahead), their encoder state put in the voices' state dicts. Rows are padded to one of
    ``rows`` (empty rows), tokens to a multiple of ``token_bucket`` up to ``max_tokens``; ``replay``
    (CUDA only): each shape replayed from a CUDA graph, all captured by :meth:`capture_all` on the
    stream of ``role`` (:func:`~cosyserve.runtime.role_stream`: the thread's that replays them);
    otherwise (and past the shapes) the same padded pass runs eagerly."""

    def __init__(self, flow: CosyVoice2Flow, rows: tuple[int, ...], max_tokens: int, token_bucket: int, *,
                 replay: bool = True, role: str = LOOP_ROLE) -> None:
        self.flow = flow
        self.rows = rows
        self.token_bucket = token_bucket
        self.widths = tuple(range(token_bucket, max_tokens + token_bucket, token_bucket))
        self._layouts: dict[tuple[int, int], list[torch.Size]] = {}  # (rows, tokens) -> the outputs' shapes
        self.graphs = (GraphCache(self._pass, max_graphs=len(rows) * len(self.widths), capture_after=None, role=role)
                       if replay else None)

    @property
    def captured(self) -> int:
        return 0 if self.graphs is None else self.graphs.num_graphs

    def capture_all(self) -> None:
        """Capture every shape's graph now (at load: a capture beside serving chunks would stall them)."""
        if self.graphs is None:
            return
        device = self.flow.input_embedding.weight.device
        for rows in self.rows:
            for width in self.widths:
                lengths = torch.full((rows,), width, device=device, dtype=torch.long)
                self.graphs.capture(torch.zeros(rows, width, device=device, dtype=torch.long), lengths, lengths)

    def __call__(self, tokens: list[torch.Tensor], commits: list[int], states: list[dict]) -> list[torch.Tensor]:
        """mu (1, 80, 2 (n - lookahead)) of each first piece ``tokens[j]`` (1, n) on the device, whose first
        ``commits[j]`` tokens become final: their encoder state is put in ``states[j]`` (empty)."""
        lookahead = self.flow.cfg.pre_lookahead_len
        sizes = [t.size(1) for t in tokens]
        rows = bucket(len(tokens), self.rows) or len(tokens)
        width = -(-max(sizes) // self.token_bucket) * self.token_bucket
        packed = pad_sequence([t[0] for t in tokens], batch_first=True)
        packed = F.pad(packed, (0, width - packed.size(1), 0, rows - packed.size(0)))
        idle = [0] * (rows - len(tokens))
        lengths, valid = host_to_device([sizes + idle, [max(n - lookahead, 0) for n in sizes] + idle],
                                        packed.device, torch.long)
        replayed = self.graphs is not None and width <= self.widths[-1] and rows in self.rows
        (flat,) = self.graphs(packed, lengths, valid) if replayed else self._pass(packed, lengths, valid)
        mu, *kept = self._unflatten(flat, (rows, width))
        keep_first_states(self.flow.encoder, states, sizes, commits, kept)
        return [mu[j:j + 1, :, :UP_STRIDE * (n - lookahead)] for j, n in enumerate(sizes)]

    def _pass(self, tokens: torch.Tensor, lengths: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor]:
        """The padded pass (device work only: a graph may capture it): mu and the kept state, flat."""
        embedded = self.flow.input_embedding(tokens.clamp(min=0))
        x, kept = encode_first_windows(self.flow.encoder, embedded, lengths, valid)
        outputs = [self.flow.project(x), *kept]
        self._layouts[tuple(tokens.shape)] = [t.shape for t in outputs]
        return (torch.cat([t.reshape(-1) for t in outputs]),)

    def _unflatten(self, flat: torch.Tensor, shape: tuple[int, int]) -> list[torch.Tensor]:
        shapes = self._layouts[shape]
        return [part.view(s) for part, s in zip(flat.split([s.numel() for s in shapes]), shapes)]
