"""token2wav.py on tiny random-weight bundles: one benchmark module over the engine's kinds
(cosyserve/bench/token2wav.py), every model offline and streaming in its kind's chunks (960 samples
per token), variants, profiling, clear errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from cosyserve.bench import token2wav as bench
from cosyserve.bundle import make_bundle
from cosyserve.errors import InvalidInputError
from cosyserve.runtime import COSYVOICE2_DIR, COSYVOICE3_DIR, STEP_AUDIO2_DIR
from cosyserve.schedule import plan_chunks, plan_stream_chunks

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import token2wav  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cv3_bundle(tmp_path_factory) -> Path:
    return make_bundle(tmp_path_factory.mktemp("cv3_t2w"), "tiny", parts=("cosyvoice3",))


@pytest.fixture(scope="module")
def prompt(cv3_bundle) -> tuple[Path, str]:
    assets = cv3_bundle / "assets"
    return assets / "prompt_audio.wav", (assets / "prompt_text.txt").read_text(encoding="utf-8").strip()


@pytest.fixture(scope="module")
def loaded(cv3_bundle, prompt):
    """CosyVoice3's kind and a clip's features, as token2wav.py loads them."""
    model_dir = cv3_bundle / COSYVOICE3_DIR
    device = torch.device("cpu")
    kind = bench.load_kind("cosyvoice3", model_dir, device, bench.Variant())
    return kind, bench.load_voice("cosyvoice3", model_dir, device, prompt[0])


def _cv3_args(bundle_dir: Path, prompt, *extra: str) -> list[str]:
    wav, text = prompt
    return ["--model", "cosyvoice3", "--model-dir", str(bundle_dir), "--reference-audio", str(wav),
            "--reference-text", text, "--device", "cpu", *extra]


@pytest.mark.parametrize("mode", ["offline", "streaming"])
def test_cosyvoice3_gives_960_samples_per_token(cv3_bundle, prompt, tmp_path, capsys, mode):
    lengths = [7, 40, 100]
    out, report = tmp_path / "last.wav", tmp_path / "report.json"
    # offline: the model directory; streaming: the bundle root holding it (both are taken)
    model_dir = cv3_bundle / COSYVOICE3_DIR if mode == "offline" else cv3_bundle
    assert token2wav.main(_cv3_args(model_dir, prompt, "--num-tokens", *map(str, lengths), "--mode", mode,
                                    "--variants", "fp32,fp32+batch3",
                                    "--output", str(out), "--output-json", str(report))) == 0
    printed = capsys.readouterr().out
    assert "model=cosyvoice3" in printed and f"| fp32 | {mode}" in printed
    result = json.loads(report.read_text())
    assert result["model"] == "cosyvoice3" and result["mode"] == mode
    fp32 = result["results"]["fp32"]
    assert fp32["samples"] == [960 * n for n in lengths]
    assert fp32["audio_s"] == pytest.approx(sum(lengths) * 0.04)
    expected = [[{"num_tokens": n, "token_offset": 0, "finalize": True}] if mode == "offline"
                else [vars(c) for c in plan_chunks(n)] for n in lengths]
    assert fp32["chunks"] == expected
    # three utterances voiced together (their jobs packed per step): the same audio
    batched = result["results"]["fp32+batch3"]
    assert batched["chunks"] == expected and batched["rel_l2_vs_first"] < 1e-5
    wave, rate = sf.read(out, dtype="float32")
    assert rate == 24000 and wave.size == 960 * lengths[-1]
    assert np.isfinite(wave).all() and np.abs(wave).max() > 0


def test_the_reference_re_run_is_a_variant_compared_with_the_incremental_flow(cv3_bundle, prompt, tmp_path, capsys):
    """``fp32,fp32+rerun``: the second row streams with the reference's full-attention re-run and
    reports its rel-L2 against the incremental block-masked stream; both give 960 samples per token.
    ``--profile``: each variant's last utterance once more under torch.profiler, the host time of its
    flow steps and vocoder calls."""
    report = tmp_path / "report.json"
    assert token2wav.main(_cv3_args(cv3_bundle, prompt, "--num-tokens", "60", "--mode", "streaming",
                                    "--variants", "fp32,fp32+rerun", "--profile", "--output-json", str(report))) == 0
    results = json.loads(report.read_text())["results"]
    assert results["fp32"]["samples"] == results["fp32+rerun"]["samples"] == [960 * 60]
    assert results["fp32"]["rel_l2_vs_first"] == 0
    assert 0 < results["fp32+rerun"]["rel_l2_vs_first"] < float("inf")
    for name in ("fp32", "fp32+rerun"):
        profile = results[name]["profile"]
        assert profile["tokens"] == 60 and profile["calls"] == len(plan_chunks(60))
        assert 0 < profile["flow_host_ms"] + profile["vocoder_host_ms"] <= profile["wall_ms"]
        assert profile["flow_host_ms"] > 0 and profile["vocoder_host_ms"] > 0
    assert "under torch.profiler" in capsys.readouterr().out


@pytest.mark.parametrize("n", [1, 17, 18, 43, 60])
def test_streaming_chunks_are_the_engines_and_total_960_per_token(loaded, n):
    kind, features = loaded
    tokens = torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(n))
    (stream,) = bench.synthesize(kind, features, [tokens], "streaming")
    (offline,) = bench.synthesize(kind, features, [tokens], "offline")
    assert stream.chunks == plan_chunks(n)  # the exponential schedule the engine sends
    assert len(stream.pieces) == len(stream.call_s) == len(stream.chunks)
    assert sum(p.size for p in stream.pieces) == stream.wave.size == offline.wave.size == 960 * n
    for wave in (stream.wave, offline.wave):
        assert wave.dtype == np.float32 and np.isfinite(wave).all() and np.abs(wave).max() > 0
    assert kind.open_streams == 0  # every stream closed


def test_bad_token_id_is_a_clear_error(cv3_bundle, prompt, loaded, tmp_path, capsys):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("1 2 3\n4 6561 5\n")
    assert token2wav.main(_cv3_args(cv3_bundle, prompt, "--tokens-file", str(tokens))) == 2
    err = capsys.readouterr().err
    assert "utterance 2" in err and "6561" in err and "0..6560" in err
    tokens.write_text("-1 2 3\n")
    assert token2wav.main(_cv3_args(cv3_bundle, prompt, "--tokens-file", str(tokens), "--mode", "streaming")) == 2
    assert "0..6560" in (err := capsys.readouterr().err) and "got ids in -1..3" in err
    # the kind itself: a clear error in both modes, no stream left open
    kind, features = loaded
    for mode in bench.MODES:
        with pytest.raises(InvalidInputError, match="0..6560"):
            bench.synthesize(kind, features, [[5] * 20 + [7000]], mode)
    assert kind.open_streams == 0


@pytest.mark.parametrize("extra, message", [
    (("--variants", "fp16+batch4+batch2"), "takes flow dtypes"),
    (("--variants", "fp16+rerun+rerun"), "takes flow dtypes"),
    (("--variants", "fp8"), "takes flow dtypes"),
    (("--model-dir", "{cv2}"), "holds no speech_tokenizer_v3.onnx"),
    (("--reference-audio", "{missing}"), "nothing.wav"),
])
def test_cosyvoice3_input_errors(cv3_bundle, prompt, tmp_path, capsys, extra, message):
    extra = [x.format(cv2=tmp_path, missing=tmp_path / "nothing.wav") for x in extra]
    assert token2wav.main(_cv3_args(cv3_bundle, prompt, "--num-tokens", "5", *extra)) == 2
    assert message in capsys.readouterr().err


def test_argument_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        token2wav.parse_args(["--model-dir", str(tmp_path), "--num-tokens", "5", "--model", "cosyvoice3"])
    assert exit_.value.code == 2 and "needs --reference-audio" in capsys.readouterr().err


def test_variant_flags_are_the_kinds():
    assert bench.Variant.parse("bf16+batch4+rerun", "cosyvoice3").name == "bf16+rerun+batch4"
    assert bench.Variant.parse("fp16+graphs", "cosyvoice2") == bench.Variant("fp16", graphs=True)
    for spec, model in (("fp32+rerun", "cosyvoice2"), ("fp32+graphs", "step_audio2")):
        with pytest.raises(InvalidInputError, match=f"--model {model} takes"):
            bench.Variant.parse(spec, model)


@pytest.mark.parametrize("mode", ["offline", "streaming"])
def test_cosyvoice2_is_the_default(tmp_path_factory, tmp_path, capsys, mode):
    bundle = make_bundle(tmp_path_factory.mktemp("cv2_t2w"), "tiny", parts=("cosyvoice2",))
    out, report = tmp_path / "last.wav", tmp_path / "report.json"
    assert token2wav.main(["--model-dir", str(bundle / COSYVOICE2_DIR), "--num-tokens", "10", "20", "--mode", mode,
                           "--variants", "fp32,fp32+batch2", "--output", str(out), "--output-json", str(report)]) == 0
    assert f"| fp32 | {mode}" in capsys.readouterr().out
    result = json.loads(report.read_text())
    assert result["model"] == "cosyvoice2" and result["results"]["fp32"]["samples"] == [9600, 19200]
    assert result["results"]["fp32+batch2"]["rel_l2_vs_first"] < 1e-5  # HiFT's noise: seed and length only
    assert sf.read(out)[0].size == 960 * 20


@pytest.fixture(scope="module")
def sa2_bundle(tmp_path_factory) -> Path:
    return make_bundle(tmp_path_factory.mktemp("sa2_t2w"), "tiny", parts=("cosyvoice2", "step_audio2"))


@pytest.mark.parametrize("mode, strategy", [("offline", "exponential"), ("streaming", "equal"),
                                            ("streaming", "exponential")])
def test_step_audio2_gives_960_samples_per_token(sa2_bundle, tmp_path, capsys, mode, strategy):
    """--model step_audio2 (the engine's kind cosyvoice2_dit serves): a clip or a voice of CosyVoice2's
    spk2info.pt; streaming voices cosyvoice2_dit's chunks (equal: 15 new tokens each)."""
    out, report = tmp_path / "last.wav", tmp_path / "report.json"
    base = ["--model", "step_audio2", "--model-dir", str(sa2_bundle / STEP_AUDIO2_DIR), "--num-tokens", "20", "47",
            "--mode", mode, "--strategy", strategy, "--runs", "1", "--output", str(out), "--output-json", str(report)]
    voices = [["--reference-audio", str(sa2_bundle / "assets" / "prompt_audio.wav")],
              ["--spk2info", str(sa2_bundle / COSYVOICE2_DIR / "spk2info.pt"), "--speaker-id", "001"]]
    for voice in voices:
        assert token2wav.main(base + voice) == 0
        assert "model=step_audio2" in capsys.readouterr().out
        fp32 = json.loads(report.read_text())["results"]["fp32"]
        chunks = 2 if mode == "offline" else sum(len(plan_stream_chunks(n, strategy)) for n in (20, 47))
        assert sum(map(len, fp32["chunks"])) == chunks and fp32["samples"] == [960 * 20, 960 * 47]
        audio = sf.read(out)[0]
        assert audio.size == 960 * 47 and np.isfinite(audio).all() and np.abs(audio).max() > 0
    assert token2wav.main(base[:-4] + voices[0] + ["--strategy", "time_based"]) == 2  # CosyVoice3's, not the DiT's
    assert "unknown chunk strategy 'time_based'" in capsys.readouterr().err
    assert token2wav.main(base[:-4]) == 2  # no voice: the DiT directory has no spk2info.pt
    assert "needs --reference-audio, or --spk2info" in capsys.readouterr().err
