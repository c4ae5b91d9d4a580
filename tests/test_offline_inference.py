"""offline_inference.py on the tiny bundle: wavs + reports, fixed lengths, batching invariance, clear errors."""

from __future__ import annotations

import importlib.util
import json
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyserve.errors import InvalidInputError
from cosyserve.frontend.prompt import PromptFeatures
from cosyserve.data import FixedLength
from cosyserve.offline import estimate_seconds, share_tokens, spoken_characters
from cosyserve.engine.front_end import Voice

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import offline_inference  # noqa: E402

torch.set_num_threads(1)
TARGETS = ["身临其境，换新体验。", "塑造开源语音合成新范式，让智能语音更自然。", "你好，世界。"]


@pytest.fixture(scope="module")
def manifest(tiny_bundle, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "manifest.txt"
    prompt_text = (tiny_bundle / "assets" / "prompt_text.txt").read_text(encoding="utf-8").strip()
    wav = tiny_bundle / "assets" / "prompt_audio.wav"
    path.write_text("".join(f"utt{i}|{prompt_text}|{wav}|{t}\n" for i, t in enumerate(TARGETS)), encoding="utf-8")
    return path


def _run(tiny_bundle, manifest, out: Path, *extra: str) -> int:
    return offline_inference.main(["--model-dir", str(tiny_bundle), "--manifest-path", str(manifest),
                                   "--output-dir", str(out), "--device", "cpu", "--no-progress", *extra])


def _read_wav(path: Path) -> np.ndarray:
    with wave.open(str(path)) as handle:
        assert handle.getframerate() == 24000 and handle.getnchannels() == 1 and handle.getsampwidth() == 2
        return np.frombuffer(handle.readframes(handle.getnframes()), "<i2").astype(np.float32) / 32767


def test_manifest_run_writes_wavs_and_reports(tiny_bundle, manifest, tmp_path):
    out = tmp_path / "out"
    assert _run(tiny_bundle, manifest, out, "--batch-size", "2", "--token2wav-batch-size", "2",
                "--fixed-output-seconds", "0.4", "0.8", "--seed", "3") == 0
    report = json.loads((out / "report.json").read_text())
    expected_tokens = [round(25 * s) for s in FixedLength(25, (0.4, 0.8), 3).draws(3)]
    assert [r["speech_tokens"] for r in report["per_item"]] == expected_tokens
    assert len(set(expected_tokens)) > 1  # the draws really spread
    for item, tokens in zip(report["per_item"], expected_tokens):
        audio = _read_wav(out / item["wav"])
        assert audio.size == tokens * 960 and np.abs(audio).max() > 0
        assert item["audio_s"] == pytest.approx(tokens * 0.04)
    assert report["items"] == 3 and report["audio_s"] == pytest.approx(sum(expected_tokens) * 0.04)
    # wall time: the front-end (voices, text) then the engine (LLM, flow and HiFT interleaved in its loop)
    assert min(report["frontend_time_s"], report["engine_time_s"]) > 0
    assert report["total_time_s"] == pytest.approx(report["frontend_time_s"] + report["engine_time_s"])
    assert report["rtf"] == pytest.approx(report["total_time_s"] / report["audio_s"])
    engine = report["engine"]  # the loop's counters over the run, and our LLM's on its own thread: every token voiced
    assert min(engine["llm_busy_s"], engine["flow_s"], engine["vocoder_s"]) > 0
    assert engine["tokens"] == sum(expected_tokens) and engine["requests_finished"] == 3
    assert engine["flow_s"] + engine["vocoder_s"] <= report["engine_time_s"] * 1.05 + 0.05
    assert engine["llm_busy_s"] <= report["engine_time_s"] * 1.05 + 0.05
    markdown = (out / "report.md").read_text()
    assert "engine time" in markdown and "flow_s" in markdown and "RTF" in markdown and "utt2" in markdown


def test_batch_sizes_do_not_change_the_audio(tiny_bundle, manifest, tmp_path):
    """Seeded sampling is per request, the engine's packed flow passes equal single ones and HiFT's
    noise depends on the seed and the length only: same wavs, whatever the batch sizes."""
    common = ("--speaker-id", "001", "--fixed-tokens-per-second", "25", "--backend", "hf")
    assert _run(tiny_bundle, manifest, tmp_path / "a", "--batch-size", "1", "--token2wav-batch-size", "1", *common) == 0
    assert _run(tiny_bundle, manifest, tmp_path / "b", "--batch-size", "3", "--token2wav-batch-size", "3", *common) == 0
    reports = [json.loads((tmp_path / d / "report.json").read_text()) for d in "ab"]
    assert reports[0]["per_item"] == reports[1]["per_item"]
    assert reports[1]["backend"] == "hf" and reports[1]["token2wav_batch_size"] == 3
    for item in reports[0]["per_item"]:
        a, b = (_read_wav(tmp_path / d / item["wav"]) for d in "ab")
        assert a.size == b.size and np.abs(a - b).max() <= 2 / 32767  # PCM rounding of fp-level differences


def test_a_long_text_is_voiced_segment_by_segment_into_one_wav(tiny_bundle, tmp_path):
    long_text = "一二三四五六七八九十。" * 20  # three segments (77, 77, 66 characters)
    manifest = tmp_path / "long.txt"
    manifest.write_text(f"long|unused|unused.wav|{long_text}\n", encoding="utf-8")
    out = tmp_path / "out"
    assert _run(tiny_bundle, manifest, out, "--speaker-id", "001", "--fixed-output-seconds", "1.2") == 0
    (item,) = json.loads((out / "report.json").read_text())["per_item"]
    assert item["segments"] == 3
    assert item["speech_tokens"] == 30  # 1.2 s at 25 tokens/s, shared 10/11/9 by the segments' spoken characters
    assert _read_wav(out / "long.wav").size == 30 * 960


def test_share_tokens():
    assert share_tokens(30, [70, 70, 60]) == [10, 11, 9]
    assert share_tokens(2, [5, 0, 5]) == [1, 1, 1]  # every segment says something
    assert sum(share_tokens(1000, [3, 1, 4, 1, 5])) == 1000


def test_length_estimate_follows_the_prompt_speaking_rate():
    features = PromptFeatures(torch.zeros(75, dtype=torch.int32), torch.zeros(150, 80), torch.zeros(192))
    voice = Voice("希望你以后能够做的比我还好呦。", features)  # 14 characters in 3 s
    assert spoken_characters("Hello, world 42!") == 12
    assert estimate_seconds(voice, "身临其境，换新体验。") == pytest.approx(3.0 * 8 / 14)
    with pytest.raises(InvalidInputError, match="no letters"):
        estimate_seconds(Voice("...", features), "你好")


def test_fixed_length_limits():
    fixed = FixedLength(25, (4.0, 10.0), seed=1)
    draws = fixed.draws(50)
    assert draws == FixedLength(25, (4.0, 10.0), seed=1).draws(50) and 4.0 <= min(draws) < max(draws) <= 10.0
    assert fixed.tokens(6.02) == 150 and fixed.tokens(0.001) == 1
    assert FixedLength(25, None).draws(2) == [None, None]
    for bad in ((0.0,), (5.0, 4.0), (1.0, 2.0, 3.0)):
        with pytest.raises(InvalidInputError):
            FixedLength(25, bad)


@pytest.mark.parametrize("args, message", [
    (("--backend", "vllm"), "vllm backend is not supported yet"),
    (("--batch-size", "0"), "batch_size must be >= 1"),
    (("--max-items", "0"), "--max-items"),
])
def test_clear_errors(tiny_bundle, manifest, tmp_path, capsys, args, message):
    assert _run(tiny_bundle, manifest, tmp_path, *args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="tensorrt_llm is installed")
def test_trtllm_without_tensorrt_llm_names_the_package(tiny_bundle, manifest, tmp_path, capsys):
    assert _run(tiny_bundle, manifest, tmp_path, "--backend", "trtllm") == 2
    assert "tensorrt_llm" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_huggingface_dataset_without_datasets_names_the_package(tiny_bundle, tmp_path, capsys):
    assert offline_inference.main(["--model-dir", str(tiny_bundle), "--huggingface-dataset", "yuekai/seed_tts_cosy2",
                                   "--output-dir", str(tmp_path)]) == 2
    assert "`datasets`" in capsys.readouterr().err


def test_missing_model_dir(manifest, tmp_path, capsys):
    assert offline_inference.main(["--model-dir", str(tmp_path / "nothing"), "--manifest-path", str(manifest),
                                   "--output-dir", str(tmp_path / "out"), "--device", "cpu"]) == 2
    assert "CosyVoice2-0.5B" in capsys.readouterr().err


def test_cosyvoice3_model_kind(tmp_path_factory, manifest, tmp_path):
    """--model cosyvoice3 on CosyVoice3's tiny bundle: its prompt layout, v3 tokenizer and DiT
    token2wav; 960 samples per generated token, as for CosyVoice2."""
    from cosyserve.bundle import make_bundle

    models = make_bundle(tmp_path_factory.mktemp("cv3_offline"), "tiny", parts=("cosyvoice3", "cosyvoice3_llm"))
    out = tmp_path / "out"
    assert offline_inference.main(["--model", "cosyvoice3", "--model-dir", str(models), "--manifest-path",
                                   str(manifest), "--output-dir", str(out), "--device", "cpu", "--no-progress",
                                   "--fixed-output-seconds", "0.4", "--max-items", "2"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "cosyvoice3" and report["items"] == 2
    for item in report["per_item"]:
        assert item["speech_tokens"] == 10
        audio = _read_wav(out / item["wav"])
        assert audio.size == 10 * 960 and np.abs(audio).max() > 0
    # CosyVoice2's bundle does not hold CosyVoice3's directories, and CosyVoice3 has no registered voices
    assert offline_inference.main(["--model", "cosyvoice3", "--model-dir", str(manifest.parent), "--manifest-path",
                                   str(manifest), "--output-dir", str(out), "--device", "cpu"]) == 2


def test_step_audio2_model_kind(tmp_path_factory, manifest, tmp_path, capsys):
    """--model step_audio2: CosyVoice2's LLM and voices, Step-Audio-2-mini's DiT token2wav (the
    bundle's Step-Audio-2-mini/token2wav/): 960 samples per generated token, for a clip and for a
    registered voice; a bundle without the DiT directory is a clear error."""
    from cosyserve.bundle import make_bundle

    models = make_bundle(tmp_path_factory.mktemp("sa2_offline"), "tiny", parts=("cosyvoice2", "llm", "step_audio2"))
    for name, extra in (("clip", ()), ("registered", ("--speaker-id", "001"))):
        out = tmp_path / name
        assert offline_inference.main(["--model", "step_audio2", "--model-dir", str(models), "--manifest-path",
                                       str(manifest), "--output-dir", str(out), "--device", "cpu", "--no-progress",
                                       "--fixed-output-seconds", "0.4", "--max-items", "2", *extra]) == 0
        report = json.loads((out / "report.json").read_text())
        assert report["model"] == "step_audio2" and report["items"] == 2
        for item in report["per_item"]:
            assert item["speech_tokens"] == 10
            audio = _read_wav(out / item["wav"])
            assert audio.size == 10 * 960 and np.abs(audio).max() > 0
    capsys.readouterr()
    assert offline_inference.main(["--model", "step_audio2", "--model-dir", str(manifest.parent), "--manifest-path",
                                   str(manifest), "--output-dir", str(tmp_path / "none"), "--device", "cpu"]) == 2
    assert "Step-Audio-2-mini/token2wav" in capsys.readouterr().err
