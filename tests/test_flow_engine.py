"""The token2wav flow engine (incremental, packed streams, voice prefixes) against the full re-run of every prefix."""

from __future__ import annotations

import random

import pytest
import torch

from cosyserve.errors import CapacityError, InvalidInputError
from cosyserve.models.flow import CosyVoice2Flow, FlowConfig, random_flow_state_dict
from cosyserve.schedule import plan_chunks
from cosyserve.token2wav.flow_engine import FlowEngine

torch.set_num_threads(1)

REL_L2 = 1e-5  # fp32: the bound for "equal up to rounding"
LOOKAHEAD = 3


@pytest.fixture(scope="module")
def flow() -> CosyVoice2Flow:
    cfg = FlowConfig.tiny()
    model = CosyVoice2Flow(cfg)
    model.load_state_dict(random_flow_state_dict(cfg, seed=5))
    return model.eval()


def _voice(prompt_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 6561, (1, prompt_tokens), generator=g),
            torch.randn(1, 2 * prompt_tokens, 80, generator=g), torch.randn(1, 192, generator=g))


def _tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 6561, (1, count), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _engine(flow: CosyVoice2Flow, pages: int = 200, **kwargs) -> FlowEngine:
    return FlowEngine(flow, pool_pages=pages, **kwargs)


def upstream_schedule(prompt_tokens: int, total: int) -> list[tuple[int, bool]]:
    """Upstream CosyVoice's own Python streaming: the first hop padded so that prompt + hop ends on
    the 25-token grid, then 25, 50, 100 (capped), each with 3 look-ahead tokens; then the final."""
    first = 25 - prompt_tokens % 25 or 25
    chunks, count, hop = [], first, 25
    while count + LOOKAHEAD < total:
        chunks.append((count + LOOKAHEAD, False))
        count += hop
        hop = min(2 * hop, 100)
    return chunks + [(total, True)]


def triton_schedule(total: int) -> list[tuple[int, bool]]:
    """The reference BLS's: 15 + 3 look-ahead, then 25 * 2^k."""
    chunks = plan_chunks(total)
    return [(c.num_tokens, c.finalize) for c in chunks]


class Reference:
    """One stream's chunks and the full re-run's mel for each (streaming masks throughout)."""

    def __init__(self, flow, voice, tokens, schedule):
        self.flow, self.voice, self.tokens, self.schedule = flow, voice, tokens, schedule
        self.done = 0

    def expected(self, count: int, finalize: bool) -> torch.Tensor:
        full = self.flow.inference(self.tokens[:, :count], *self.voice, streaming=True, finalize=finalize)
        return full[:, :, self.done:]


@pytest.mark.parametrize("schedule_kind", ["triton", "upstream"])
@pytest.mark.parametrize("prompt_tokens", [20, 28, 53, 75])
def test_chunks_equal_full_rerun(flow, schedule_kind: str, prompt_tokens: int):
    """Every chunk of a stream equals the full re-run, with the voice prefix cached or not (P mod 25
    across 0..3 and beyond: the prompt tail crossing into the target through the look-ahead)."""
    engine = _engine(flow)
    voice, tokens = _voice(prompt_tokens, seed=prompt_tokens), _tokens(140, seed=1)
    schedule = triton_schedule(140) if schedule_kind == "triton" else upstream_schedule(prompt_tokens, 140)
    for repeat in range(2):  # the second stream starts from the cached prefix
        stream = engine.open(*voice)
        ref = Reference(flow, voice, tokens, schedule)
        for count, finalize in schedule:
            got = engine.run([(stream, tokens[:, :count], finalize)])[0]
            expected = ref.expected(count, finalize)
            assert got.shape == expected.shape and _rel(got, expected) < REL_L2, (repeat, count, _rel(got, expected))
            ref.done += got.size(2)
        assert stream.closed
    assert engine.cached_voices == 1 and engine.open_streams == 0


def test_mixed_voices_and_batch_compositions(flow):
    """Streams of several voices (cached and not) at different points of their schedules, packed in
    random groups: each chunk equals the full re-run, and a packed row equals the same row alone."""
    engine, alone = _engine(flow), _engine(flow)
    voices = [_voice(p, seed=10 + p) for p in (20, 33, 60)]
    rng = random.Random(0)
    streams = []
    for k in range(5):
        voice = voices[k % len(voices)]
        tokens = _tokens(rng.randint(60, 130), seed=100 + k)
        schedule = triton_schedule(tokens.size(1)) if k % 2 else upstream_schedule(voice[0].size(1), tokens.size(1))
        streams.append((engine.open(*voice), alone.open(*voice), Reference(flow, voice, tokens, schedule), iter(schedule)))
    pending = {k: next(s[3]) for k, s in enumerate(streams)}
    while pending:
        group = rng.sample(sorted(pending), rng.randint(1, len(pending)))
        chunks = [(streams[k][0], streams[k][2].tokens[:, :pending[k][0]], pending[k][1]) for k in group]
        mels = engine.run(chunks)
        for k, mel in zip(group, mels):
            _, lone, ref, schedule = streams[k]
            count, finalize = pending[k]
            assert _rel(mel, ref.expected(count, finalize)) < REL_L2, (k, count)
            solo = alone.run([(lone, ref.tokens[:, :count], finalize)])[0]
            assert _rel(mel, solo) < REL_L2
            ref.done += mel.size(2)
            following = next(schedule, None)
            if following is None:
                del pending[k]
            else:
                pending[k] = following
    assert engine.open_streams == 0
    assert engine.pool.free_pages == engine.pool.pages - sum(len(v.state.pages) for v in engine._voices.values())


def test_pages_return_after_finish_cancel_and_error(flow):
    engine = _engine(flow)
    voice, tokens = _voice(60, seed=3), _tokens(150, seed=4)
    engine.open(*voice).close()  # computes the prefix
    voice_pages = engine.pool.pages - engine.pool.free_pages
    assert voice_pages == 2  # 50 * floor((60 - 3) / 25) frames = 100 frames = 2 pages

    cancelled = engine.open(*voice)
    engine.run([(cancelled, tokens[:, :93], False)])
    assert engine.pool.pages - engine.pool.free_pages > voice_pages
    cancelled.close()
    cancelled.close()  # idempotent
    failed = engine.open(*voice)
    engine.run([(failed, tokens[:, :43], False)])
    with pytest.raises(InvalidInputError, match="extend"):
        engine.run([(failed, _tokens(60, seed=9), False)])
    assert failed.closed
    with pytest.raises(InvalidInputError, match="closed"):
        engine.run([(failed, tokens[:, :60], False)])
    assert engine.open_streams == 0 and engine.pool.pages - engine.pool.free_pages == voice_pages


def test_full_pool_refuses_a_stream_and_evicts_unused_voices(flow):
    engine = _engine(flow, pages=5)
    engine.open(*_voice(60, seed=1)).close()  # 2 pages kept for the voice, unused
    stream = engine.open(*_voice(20, seed=2))  # no prefix pages
    tokens = _tokens(160, seed=5)
    engine.run([(stream, tokens[:, :103], False)])  # 200 complete frames: 4 pages, the unused voice's freed
    assert engine.cached_voices == 1 and engine.pool.free_pages == 1
    with pytest.raises(CapacityError, match="state pool is full"):
        engine.run([(stream, tokens[:, :153], False)])  # 300 frames: 2 more pages
    assert stream.closed and engine.pool.free_pages == engine.pool.pages


def test_voices_are_keyed_by_content(flow):
    """Same prompt tokens, different clip: two voices (the reference keys speakers by transcript alone)."""
    engine = _engine(flow)
    tokens, feat, embedding = _voice(40, seed=7)
    engine.open(tokens, feat, embedding).close()
    engine.open(tokens, feat + 0.1, embedding).close()
    engine.open(tokens, feat, embedding).close()
    assert engine.cached_voices == 2
