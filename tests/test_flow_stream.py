"""Incremental streaming flow (FlowStream) against the upstream-style full re-run of every prefix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cosyserve.errors import InvalidInputError
from cosyserve.models.flow import (
    CosyVoice2Flow,
    EncoderConfig,
    EstimatorConfig,
    FlowConfig,
    FlowStream,
    flow_from_state_dict,
    random_flow_state_dict,
)

torch.set_num_threads(1)

# README section 2: flow mel vs the fp64 reference lands at ~2.5e-6; the re-run is our own fp32 code.
REL_L2 = 1e-4
LOOKAHEAD = 3
# The Triton scheduler's chunks for hops 15, 25, 50, 100 (each carries 3 look-ahead tokens).
TRITON = [18, 43, 93, 193]


def _flow(cfg: FlowConfig, seed: int) -> CosyVoice2Flow:
    model = CosyVoice2Flow(cfg)
    model.load_state_dict(random_flow_state_dict(cfg, seed=seed))
    return model.eval()


@pytest.fixture(scope="module")
def tiny_flow() -> CosyVoice2Flow:
    return _flow(FlowConfig.tiny(), seed=5)


def _prompt(prompt_tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 6561, (1, prompt_tokens), generator=g),
            torch.randn(1, 2 * prompt_tokens, 80, generator=g), torch.randn(1, 192, generator=g))


def _tokens(count: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 6561, (1, count), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _run_schedule(flow: CosyVoice2Flow, prompt: tuple, tokens: torch.Tensor, schedule: list[int],
                  final: int | None, streaming_final: bool = False) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Step a stream through ``schedule`` (then finalize with ``final`` tokens); return (tokens, got, full re-run)."""
    stream = FlowStream(flow, *prompt, streaming_final=streaming_final)
    results = []
    for count, finalize in [(n, False) for n in schedule] + ([(final, True)] if final else []):
        done = stream.frames_returned
        got = stream.step(tokens[:, :count], finalize=finalize)
        streaming = not finalize or streaming_final
        full = flow.inference(tokens[:, :count], *prompt, streaming=streaming, finalize=finalize)
        results.append((count, got, full[:, :, done:]))
    assert stream.closed == bool(final)
    return results


@pytest.mark.parametrize(
    "prompt_tokens, schedule",
    [
        (20, TRITON),  # the fixture's prompt: chunks not aligned to the 25-token blocks
        (25, [28, 53, 103, 128]),  # prompt + valid tokens land exactly on block ends
        (7, [4, 5, 6, 30, 31, 50, 51, 77, 100]),  # tiny and odd hops, several per block
        (13, list(range(4, 36))),  # one token per step, across two block ends of each kind
    ],
    ids=["triton", "block-aligned", "odd-hops", "one-token-steps"],
)
def test_stream_equals_full_rerun(tiny_flow: CosyVoice2Flow, prompt_tokens: int, schedule: list[int]):
    prompt, tokens = _prompt(prompt_tokens), _tokens(schedule[-1] + 9)
    results = _run_schedule(tiny_flow, prompt, tokens, schedule, final=schedule[-1] + 9)
    for count, got, full in results:
        assert got.shape == full.shape and got.shape[2] > 0, (count, got.shape, full.shape)
        assert got.dtype == torch.float32
        assert _rel(got, full) < REL_L2, (count, _rel(got, full))
    total = torch.cat([got for _, got, _ in results], dim=2)
    assert total.shape == (1, 80, 2 * tokens.shape[1])


def test_open_block_is_revised_by_later_chunks(tiny_flow: CosyVoice2Flow):
    """Why the open block must be recomputed: the re-run with more tokens changes frames already returned."""
    prompt, tokens = _prompt(20), _tokens(60)
    first = tiny_flow.inference(tokens[:, :18], *prompt, streaming=True, finalize=False)  # frames 40..70
    second = tiny_flow.inference(tokens[:, :43], *prompt, streaming=True, finalize=False)
    # Frames 50..70 (prompt included) lie in the block [50, 100), still open after the first call.
    assert _rel(second[:, :, :10], first[:, :, :10]) < 1e-5  # complete block [0, 50): final
    assert _rel(second[:, :, 10:30], first[:, :, 10:30]) > 1e-2


@pytest.mark.parametrize("streaming_final", [False, True], ids=["nonstreaming-final", "streaming-final"])
def test_final_step_semantics(tiny_flow: CosyVoice2Flow, streaming_final: bool):
    prompt, tokens = _prompt(20), _tokens(70)
    results = _run_schedule(tiny_flow, prompt, tokens, TRITON[:2], final=70, streaming_final=streaming_final)
    count, got, full = results[-1]
    assert got.shape == (1, 80, 2 * (70 - 40)) and _rel(got, full) < REL_L2


def test_unaligned_chunk_sizes_and_left_chunk_limit():
    """Encoder blocks (10 tokens = 20 frames) that do not line up with estimator blocks (30 frames),
    and an estimator that only looks one block back."""
    cfg = FlowConfig(
        input_size=32,
        encoder=EncoderConfig(input_size=32, output_size=32, attention_heads=2, linear_units=64, num_blocks=1,
                              static_chunk_size=10),
        estimator=EstimatorConfig(channels=(32,), attention_head_dim=8, num_heads=2, n_blocks=1, num_mid_blocks=1,
                                  static_chunk_size=30, num_decoding_left_chunks=1),
    )
    flow = _flow(cfg, seed=2)
    prompt, tokens = _prompt(9), _tokens(80)
    for count, got, full in _run_schedule(flow, prompt, tokens, [5, 17, 18, 40, 41, 66], final=80,
                                          streaming_final=True):
        assert _rel(got, full) < REL_L2, (count, _rel(got, full))


def test_window_and_state_stay_bounded(tiny_flow: CosyVoice2Flow):
    """Each chunk recomputes at most its new frames plus one open estimator block; state grows linearly."""
    prompt, tokens = _prompt(20), _tokens(400)
    stream = FlowStream(tiny_flow, *prompt)
    block = tiny_flow.cfg.estimator.static_chunk_size
    sizes = []
    for count in range(28, 400, 25):
        frames = 2 * (20 + count - LOOKAHEAD)
        window = frames - stream.committed_frames
        new = stream.step(tokens[:, :count], finalize=False).shape[2]
        assert new == 50 and window < new + block
        sizes.append(stream.state_bytes / frames)
    assert max(sizes[2:]) < 1.6 * min(sizes[2:])  # bytes per frame ~constant (buffers grow by 1.5x)
    stream.close()
    assert stream.state_bytes == 0


def test_stream_reproduces_reference_chunks(parity_dir: Path):
    """The fixture's Triton schedule: the stream's new frames equal the reference's chunk{i}/mel."""
    fixtures = parity_dir / "cosyvoice2"
    if not (fixtures / "flow_tiny_io.safetensors").is_file():
        pytest.skip(f"no flow fixtures in {fixtures}")
    cfg = FlowConfig.from_fixture_json(json.loads((fixtures / "flow_tiny_config.json").read_text()))
    flow = flow_from_state_dict(cfg, torch.load(fixtures / "flow_tiny.pt", weights_only=True), "flow_tiny.pt")
    io = load_file(fixtures / "flow_tiny_io.safetensors")
    chunks = json.loads((fixtures / "fixture_meta.json").read_text())["flow_io"]["chunks"]
    stream = FlowStream(flow, io["prompt_token"], io["prompt_feat"], io["embedding"])
    for i, chunk in enumerate(chunks):
        done = stream.frames_returned
        got = stream.step(io["token"][:, :chunk["num_tokens"]], finalize=chunk["finalize"])
        assert chunk["streaming"] == (not chunk["finalize"])
        assert _rel(got, io[f"chunk{i}/mel"][:, :, done:]) < REL_L2
    assert stream.closed


def test_bad_steps(tiny_flow: CosyVoice2Flow):
    prompt, tokens = _prompt(20), _tokens(60)
    stream = FlowStream(tiny_flow, *prompt)
    stream.step(tokens[:, :18], finalize=False)
    other = tokens.clone()
    other[0, 2] += 1
    with pytest.raises(InvalidInputError, match="extend the 18 tokens"):
        stream.step(other[:, :30], finalize=False)
    with pytest.raises(InvalidInputError, match="extend"):
        stream.step(tokens[:, :10], finalize=False)
    with pytest.raises(InvalidInputError, match="no frames beyond the 30"):
        stream.step(tokens[:, :18], finalize=False)
    with pytest.raises(InvalidInputError, match="one request"):
        stream.step(torch.cat([tokens, tokens])[:, :30], finalize=False)
    with pytest.raises(InvalidInputError, match="integer"):
        stream.step(tokens[:, :30].float(), finalize=False)
    # Rejected steps leave the stream usable.
    assert stream.step(tokens[:, :30], finalize=False).shape == (1, 80, 24)
    stream.step(tokens, finalize=True)
    with pytest.raises(InvalidInputError, match="closed"):
        stream.step(tokens, finalize=True)
    with pytest.raises(InvalidInputError, match="prompt_feat"):
        FlowStream(tiny_flow, prompt[0], prompt[1][:, :-1], prompt[2])
    with pytest.raises(InvalidInputError, match="batch size"):
        FlowStream(tiny_flow, torch.cat([prompt[0]] * 2), torch.cat([prompt[1]] * 2), torch.cat([prompt[2]] * 2))
