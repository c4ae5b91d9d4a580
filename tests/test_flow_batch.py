"""Batched flow over requests of different lengths: each result equals the request run alone."""

from __future__ import annotations

import pytest
import torch

from cosyserve.errors import InvalidInputError
from cosyserve.models.flow import CosyVoice2Flow, FlowConfig, random_flow_state_dict

torch.set_num_threads(1)

# Batched and single runs differ only by float rounding (different matmul shapes).
REL_L2 = 1e-5
# (prompt tokens, target tokens): longest first and last, a prompt-less one, one shorter than a block.
SHAPES = [(20, 60), (7, 13), (31, 44), (0, 30), (12, 75)]


@pytest.fixture(scope="module")
def flow() -> CosyVoice2Flow:
    model = CosyVoice2Flow(FlowConfig.tiny())
    model.load_state_dict(random_flow_state_dict(FlowConfig.tiny(), seed=11))
    return model.eval().requires_grad_(False)


def _requests(shapes: list[tuple[int, int]]) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 6561, (1, n), generator=g), torch.randint(0, 6561, (1, p), generator=g),
             torch.randn(1, 2 * p, 80, generator=g), torch.randn(1, 192, generator=g)) for p, n in shapes]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("streaming, finalize", [(False, True), (True, True), (True, False)],
                         ids=["offline", "streaming-masks-final", "streaming-masks-lookahead"])
def test_batch_equals_single(flow: CosyVoice2Flow, streaming: bool, finalize: bool):
    requests = _requests(SHAPES)
    batched = flow.inference_batch(*zip(*requests), streaming=streaming, finalize=finalize)
    lookahead = 0 if finalize else 3
    for (token, *rest), got in zip(requests, batched):
        alone = flow.inference(token, *rest, streaming=streaming, finalize=finalize)
        assert got.shape == alone.shape == (1, 80, 2 * (token.shape[1] - lookahead))
        assert _rel(got, alone) < REL_L2


def test_padding_is_really_exercised(flow: CosyVoice2Flow):
    """The conditioning of a padded batch: masks, zeroed cond and per-item prompt frames."""
    requests = _requests(SHAPES[:2])
    c = flow.batch_conditions(*zip(*requests), streaming=False, finalize=True)
    assert c.frames == [160, 40] and c.prompt_frames == [40, 14] and c.mu.shape == (2, 80, 160)
    assert c.mask[1, 0, :40].eq(1).all() and c.mask[1, 0, 40:].eq(0).all()
    assert torch.equal(c.cond[1, :, :14], requests[1][2][0].T) and c.cond[1, :, 14:].eq(0).all()
    alone = flow.conditions(*requests[1], streaming=False, finalize=True)
    assert _rel(c.mu[1:, :, :40], alone.mu) < REL_L2


def test_estimator_ode_loop_with_padding(flow: CosyVoice2Flow):
    """The CFM Euler loop on a right-padded batch equals each item's own loop on its frames."""
    g = torch.Generator().manual_seed(4)
    lengths = [96, 37]
    mu, cond = torch.randn(2, 80, 96, generator=g), torch.randn(2, 80, 96, generator=g)
    spks = torch.randn(2, 80, generator=g)
    mask = (torch.arange(96)[None, :] < torch.tensor(lengths)[:, None]).unsqueeze(1).float()
    with torch.inference_mode():
        for streaming in (False, True):
            batched = flow.decoder(mu, mask, spks, cond, streaming=streaming)
            for b, frames in enumerate(lengths):
                alone = flow.decoder(mu[b:b + 1, :, :frames], torch.ones(1, 1, frames), spks[b:b + 1],
                                     cond[b:b + 1, :, :frames], streaming=streaming)
                assert _rel(batched[b:b + 1, :, :frames], alone) < REL_L2
        # Garbage in the padding (even huge values) must not leak into real frames.
        noisy_mu = mu.clone()
        noisy_mu[1, :, 37:] = 1e4
        out = flow.decoder(noisy_mu, mask, spks, cond, streaming=False)
        assert _rel(out[1, :, :37], flow.decoder(mu, mask, spks, cond, streaming=False)[1, :, :37]) < REL_L2


def test_bad_batches(flow: CosyVoice2Flow):
    requests = _requests(SHAPES[:2])
    tokens, prompt_tokens, prompt_feats, embeddings = map(list, zip(*requests))
    with pytest.raises(InvalidInputError, match="one tokens / prompt_tokens"):
        flow.inference_batch(tokens, prompt_tokens[:1], prompt_feats, embeddings, streaming=False, finalize=True)
    with pytest.raises(InvalidInputError, match="at least one request"):
        flow.inference_batch([], [], [], [], streaming=False, finalize=True)
    with pytest.raises(InvalidInputError, match="batch size 1"):
        pair = [torch.cat([v, v]) for v in requests[0]]
        flow.inference_batch(*([p] for p in pair), streaming=False, finalize=True)
    with pytest.raises(InvalidInputError, match="prompt_feat"):
        flow.inference_batch(tokens, prompt_tokens, prompt_feats[::-1], embeddings, streaming=False, finalize=True)
