"""CosyVoice3 flow (DiT): parity against the shared fixtures, config round trip, call contract."""

from __future__ import annotations

import pytest
import torch

from cosyserve.config import dump_hyperpyyaml, load_hyperpyyaml
from cosyserve.errors import InvalidInputError, ModelLoadError
from cosyserve.models.cosyvoice3.config import Cv3FlowConfig
from cosyserve.models.cosyvoice3.dit import block_causal_mask
from cosyserve.models.cosyvoice3.flow import CosyVoice3Flow, load_cosyvoice3_flow
from cosyserve.parity import cv3_flow


@pytest.fixture(scope="module")
def tiny_flow(tmp_path_factory) -> CosyVoice3Flow:
    model_dir = tmp_path_factory.mktemp("cv3flow")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.save(CosyVoice3Flow(Cv3FlowConfig.tiny()).state_dict(), model_dir / "flow.pt")
    dump_hyperpyyaml({"flow": Cv3FlowConfig.tiny().to_yaml_node()}, model_dir / "cosyvoice3.yaml")
    return load_cosyvoice3_flow(model_dir)


def test_parity_cv3_flow(parity_dir):
    fixture_dir = parity_dir / "cosyvoice3"
    if not cv3_flow.detect(fixture_dir):
        pytest.skip(f"no cv3_flow fixtures in {fixture_dir}")
    results = cv3_flow.run(fixture_dir)
    failed = [r for r in results if not r.passed]
    names = {r.case for r in results}
    assert {"nonstream/mel", "stream_full/mel", "chunk0/mel", "chunk1/mel", "chunk0/mel_fullattn",
            "real manifest/strict load"} <= names
    assert not failed, failed


def test_yaml_round_trip(tmp_path):
    for cfg in (Cv3FlowConfig.tiny(), Cv3FlowConfig.real()):
        dump_hyperpyyaml({"flow": cfg.to_yaml_node()}, tmp_path / "cosyvoice3.yaml")
        assert Cv3FlowConfig.from_yaml_tree(load_hyperpyyaml(tmp_path / "cosyvoice3.yaml")) == cfg


def test_unsupported_option_is_rejected(tmp_path):
    node = Cv3FlowConfig.tiny().to_yaml_node()
    node.kwargs["decoder"].kwargs["cfm_params"].kwargs["content"]["solver"] = "midpoint"
    dump_hyperpyyaml({"flow": node}, tmp_path / "cosyvoice3.yaml")
    with pytest.raises(ModelLoadError, match="solver"):
        Cv3FlowConfig.from_yaml_tree(load_hyperpyyaml(tmp_path / "cosyvoice3.yaml"))


def test_block_causal_mask():
    mask = block_causal_mask(7, 3, torch.device("cpu"))
    assert mask[0].tolist() == [True] * 3 + [False] * 4
    assert mask[4].tolist() == [True] * 6 + [False]
    assert mask[6].all()


def test_streaming_prefix_blocks_do_not_see_the_future(tiny_flow):
    """With block masks, the frames of complete 50-frame blocks do not depend on later tokens."""
    gen = torch.Generator().manual_seed(1)
    prompt, tokens = torch.randint(0, 6561, (1, 10), generator=gen), torch.randint(0, 6561, (1, 60), generator=gen)
    feat, emb = torch.randn(1, 20, 80, generator=gen), torch.randn(1, 192, generator=gen)
    short = tiny_flow.inference(tokens[:, :40], prompt, feat, emb, streaming=True, finalize=False)
    long = tiny_flow.inference(tokens, prompt, feat, emb, streaming=True, finalize=False)
    assert short.shape == (1, 80, 2 * (40 - 3)) and long.shape == (1, 80, 2 * (60 - 3))
    # Frames 0..49 of prompt+target form a complete block; their inputs (tokens < 25 and the
    # look-ahead of 3) are the same in both calls, so they are equal; later frames differ.
    first_block = 50 - 20
    torch.testing.assert_close(short[:, :, :first_block], long[:, :, :first_block], rtol=0, atol=1e-6)
    assert not torch.allclose(short[:, :, first_block + 10:], long[:, :, first_block + 10:short.shape[2]])


def test_bad_inputs_are_rejected(tiny_flow):
    prompt, feat, emb = torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 8, 80), torch.ones(1, 192)
    with pytest.raises(InvalidInputError, match="0..6560"):
        tiny_flow.inference(torch.tensor([[6561]]), prompt, feat, emb, streaming=False, finalize=True)
    with pytest.raises(InvalidInputError, match="prompt_feat"):
        tiny_flow.inference(torch.tensor([[1, 2]]), prompt, feat[:, :7], emb, streaming=False, finalize=True)
    with pytest.raises(InvalidInputError, match="look-ahead"):
        tiny_flow.inference(torch.zeros(1, 0, dtype=torch.long), prompt[:, :0], feat[:, :0], emb,
                            streaming=True, finalize=False)


def test_wrong_checkpoint_is_a_load_error(tmp_path):
    torch.save({"input_embedding.weight": torch.zeros(3, 80)}, tmp_path / "flow.pt")
    with pytest.raises(ModelLoadError, match="does not match"):
        load_cosyvoice3_flow(tmp_path, config=Cv3FlowConfig.tiny())


def test_incremental_stream_equals_block_masked_recompute(tiny_flow):
    """Every push returns the new frames of the reference's streaming=True call on all tokens so far,
    whatever the chunk sizes (blocks completed one or several at a time, pushes that add no frame)."""
    from cosyserve.models.cosyvoice3.flow import Cv3FlowStream

    gen = torch.Generator().manual_seed(2)
    prompt, tokens = torch.randint(0, 6561, (1, 13), generator=gen), torch.randint(0, 6561, (1, 120), generator=gen)
    feat, emb = torch.randn(1, 26, 80, generator=gen), torch.randn(1, 192, generator=gen)
    stream, received, emitted = Cv3FlowStream(tiny_flow, prompt, feat, emb), 0, 0
    for size in (1, 2, 15, 40, 3, 27, 60, 0):
        finalize = size == 0
        new = stream.push(tokens[:, received:received + size] if size else tokens[:, received:], finalize)
        received = received + size if size else tokens.shape[1]
        if received <= 3 and not finalize:  # everything is look-ahead: no frame yet
            assert new.shape == (1, 80, 0)
            continue
        full = tiny_flow.inference(tokens[:, :received], prompt, feat, emb, streaming=True, finalize=finalize)
        torch.testing.assert_close(new, full[:, :, emitted:], rtol=0, atol=1e-5)
        emitted = full.shape[2]
        assert stream.committed % 50 == 0 or finalize
    assert emitted == 2 * tokens.shape[1] and stream.finished
    with pytest.raises(InvalidInputError, match="finished"):
        stream.push(tokens[:, :1])
