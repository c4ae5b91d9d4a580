"""cosyserve.clients without a server: items, audio loading, request tensors, benchmark math."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from cosyserve import clients, data
from cosyserve.errors import InvalidInputError
from cosyserve.data import FixedLength

REPO_ROOT = Path(__file__).resolve().parents[1]

# --- items ---------------------------------------------------------------------------------


def test_manifest_parsing(tmp_path):
    (tmp_path / "wavs").mkdir()
    manifest = tmp_path / "list.txt"
    manifest.write_text(
        "a/utt1.wav|你好，世界。|wavs/p1.wav|今天天气很好。\n"
        "\n"
        "utt2|prompt two|/abs/p2.wav|target two\n",
        encoding="utf-8",
    )
    items = data.load_manifest(manifest)
    assert [i.id for i in items] == ["utt1", "utt2"]
    assert items[0] == data.Utterance("utt1", "你好，世界。", str(tmp_path / "wavs" / "p1.wav"), "今天天气很好。")
    assert items[1].reference_audio == "/abs/p2.wav"


@pytest.mark.parametrize("content, message", [
    ("u|a|b\n", r"list.txt:1: expected 4 '\|'-separated fields"),
    ("u|a|b|c\nu|a|b|c|d\n", r"list.txt:2: expected 4"),
    ("u|a|b|c\nx/u.wav|d|e|f\n", "'u' appears more than once"),
    ("\n\n", "no utterances"),
])
def test_manifest_errors(tmp_path, content, message):
    manifest = tmp_path / "list.txt"
    manifest.write_text(content)
    with pytest.raises(InvalidInputError, match=message):
        data.load_manifest(manifest)


def test_split_round_robin():
    items = [data.Utterance(str(i), "", "", "t") for i in range(5)]
    shares = data.split_round_robin(items, 2)
    assert [[i.id for i in s] for s in shares] == [["0", "2", "4"], ["1", "3"]]
    assert len(data.split_round_robin(items, 9)) == 5
    with pytest.raises(InvalidInputError):
        data.split_round_robin(items, 0)


def test_repeat_items_cycles_with_unique_ids():
    items = [data.Utterance(str(i), "", "", "t", speech_tokens=10 * i) for i in range(3)]
    requests = data.repeat_items(items, 7)
    assert [r.id for r in requests] == ["0_r0", "1_r0", "2_r0", "0_r1", "1_r1", "2_r1", "0_r2"]
    assert [r.speech_tokens for r in requests] == [0, 10, 20, 0, 10, 20, 0]
    assert [r.id for r in data.repeat_items(items, 2)] == ["0_r0", "1_r0"]
    assert items[0].id == "0"  # the items themselves are left alone
    with pytest.raises(InvalidInputError, match="number of requests must be >= 1"):
        data.repeat_items(items, 0)


def test_fixed_lengths_are_the_offline_draws_per_item():
    items = [data.Utterance(str(i), "", "", "t") for i in range(26)]
    fixed = FixedLength(25, (4.0, 10.0), seed=3)
    lengths = [i.speech_tokens for i in data.with_fixed_lengths(items, fixed)]
    assert lengths == [round(25 * s) for s in fixed.draws(26)]  # what offline_inference.py generates
    assert 100 <= min(lengths) < max(lengths) <= 250
    assert lengths != [i.speech_tokens for i in data.with_fixed_lengths(items, FixedLength(25, (4.0, 10.0), 4))]
    assert {i.speech_tokens for i in data.with_fixed_lengths(items, FixedLength(12.5, (2.0,)))} == {25}
    with pytest.raises(InvalidInputError, match="need the seconds"):
        data.with_fixed_lengths(items, FixedLength(25, None))


def test_client_grpc_requests_without_torch(tmp_path):
    """client_grpc.py's request list: fixed lengths drawn per item, then cycled; torch is not imported."""
    (tmp_path / "m.txt").write_text("a|p|a.wav|t1\nb|p|b.wav|t2\n", encoding="utf-8")
    script = f"""
import sys
sys.path.insert(0, {str(REPO_ROOT)!r})
import client_grpc
args = client_grpc.parse_args(["--manifest-path", {str(tmp_path / "m.txt")!r}, "--num-requests", "5",
                               "--fixed-output-seconds", "4", "10", "--seed", "1"])
name, items = client_grpc.load_items(args)
print(name, [(i.id, i.speech_tokens) for i in items], "torch" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    out = done.stdout.split(" ", 1)
    a, b = (round(25 * s) for s in FixedLength(25, (4.0, 10.0), 1).draws(2))
    assert out[0] == "m"
    assert out[1].strip() == f"[('a_r0', {a}), ('b_r0', {b}), ('a_r1', {a}), ('b_r1', {b}), ('a_r2', {a})] False"


def test_reference_audio_mono_and_resampled(tmp_path):
    t = np.arange(24000) / 24000
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), np.zeros_like(t)], axis=1).astype(np.float32) * 0.5
    sf.write(tmp_path / "s.wav", stereo, 24000, subtype="FLOAT")
    audio = data.load_reference_audio(tmp_path / "s.wav")
    assert audio.dtype == np.float32 and audio.shape == (16000,)
    # mono mix halves the amplitude (0.25); the 440 Hz tone survives resampling
    assert abs(np.abs(audio[1000:-1000]).max() - 0.25) < 0.01
    spectrum = np.abs(np.fft.rfft(audio))
    assert np.argmax(spectrum) == 440  # 1 s at 16 kHz: bin k = k Hz

    native = data.load_reference_audio({"array": np.full(8000, 0.5), "sampling_rate": 16000})
    np.testing.assert_allclose(native, np.full(8000, 0.5, dtype=np.float32), atol=1e-6)


def test_reference_audio_from_datasets_decoder():
    class Samples:  # what torchcodec's AudioDecoder.get_all_samples() returns (datasets >= 4)
        data = torch.stack([torch.full((16000,), 0.2), torch.full((16000,), 0.4)])
        sample_rate = 16000

    class Decoder:
        def get_all_samples(self):
            return Samples()

    audio = data.load_reference_audio(Decoder())
    assert audio.shape == (16000,) and abs(audio[8000] - 0.3) < 1e-6


@pytest.mark.parametrize("source, message", [
    ("missing.wav", "does not exist"),
    ({"array": np.zeros(0), "sampling_rate": 16000}, "empty"),
    ({"array": np.zeros(16000), "sampling_rate": 16000}, "silent"),
    ({"array": np.ones(16000), "sampling_rate": 8000}, "sample rate 8000 Hz is not supported"),
    ({"array": np.ones(1600), "sampling_rate": 16000}, "0.10 s long"),
])
def test_reference_audio_errors(tmp_path, source, message):
    with pytest.raises(InvalidInputError, match=message):
        data.load_reference_audio(tmp_path / source if isinstance(source, str) else source)


# --- request tensors ----------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [httpclient, grpcclient])
def test_build_inputs_matches_wire_protocol(protocol):
    wav = np.linspace(-1, 1, 321).astype(np.float64)
    inputs = clients.build_inputs(protocol, wav, "参考文本", "目标 text", speaker_id="spk1")
    by_name = {i.name(): i for i in inputs}
    assert list(by_name) == ["reference_wav", "reference_wav_len", "reference_text", "target_text", "speaker_id"]
    expected = {"reference_wav": ("FP32", [1, 321]), "reference_wav_len": ("INT32", [1, 1]),
                "reference_text": ("BYTES", [1, 1]), "target_text": ("BYTES", [1, 1]),
                "speaker_id": ("BYTES", [1, 1])}
    for name, (datatype, shape) in expected.items():
        assert by_name[name].datatype() == datatype
        assert list(by_name[name].shape()) == shape
    if protocol is grpcclient:  # raw little-endian payloads
        raw = {i.name(): i._get_content() for i in inputs}
        np.testing.assert_array_equal(np.frombuffer(raw["reference_wav"], np.float32), wav.astype(np.float32))
        assert np.frombuffer(raw["reference_wav_len"], np.int32).tolist() == [321]
        text = "目标 text".encode()
        assert raw["target_text"] == len(text).to_bytes(4, "little") + text


def test_build_inputs_without_reference():
    inputs = clients.build_inputs(grpcclient, None, "", "hello")
    assert [i.name() for i in inputs] == ["target_text"]


def test_build_inputs_instruction():
    inputs = clients.build_inputs(grpcclient, None, "", "hello", speaker_id="voice_1", instruction="用四川话说")
    by_name = {i.name(): i for i in inputs}
    assert list(by_name) == ["target_text", "speaker_id", "instruction"]
    assert by_name["instruction"].datatype() == "BYTES" and list(by_name["instruction"].shape()) == [1, 1]
    assert "用四川话说".encode() in by_name["instruction"]._get_content()


def test_build_inputs_token_limits():
    inputs = clients.build_inputs(grpcclient, None, "", "hello", max_tokens=150, min_tokens=150)
    by_name = {i.name(): i for i in inputs}
    assert list(by_name) == ["target_text", "max_tokens", "min_tokens"]
    for name in ("max_tokens", "min_tokens"):
        assert by_name[name].datatype() == "INT32" and list(by_name[name].shape()) == [1, 1]
        assert np.frombuffer(by_name[name]._get_content(), np.int32).tolist() == [150]
    only_max = clients.build_inputs(httpclient, None, "", "hello", max_tokens=7)
    assert [i.name() for i in only_max] == ["target_text", "max_tokens"]
    for kwargs, message in (({"max_tokens": 0}, "max_tokens must be >= 1"),
                            ({"min_tokens": -1}, "min_tokens must be >= 0")):
        with pytest.raises(InvalidInputError, match=message):
            clients.build_inputs(grpcclient, None, "", "hello", **kwargs)


@pytest.mark.parametrize("wav, target, message", [
    (np.zeros((2, 10)), "x", "1-D"),
    (np.zeros(0), "x", "non-empty"),
    (np.zeros(10), "", "target text is empty"),
])
def test_build_inputs_rejects_bad_requests(wav, target, message):
    with pytest.raises(InvalidInputError, match=message):
        clients.build_inputs(grpcclient, wav, "ref", target)


# --- benchmark math -----------------------------------------------------------------------


def test_latency_stats_percentiles():
    stats = clients.latency_stats([0.1 * i for i in range(1, 11)] + [None])
    assert stats["count"] == 10
    assert stats["avg_ms"] == pytest.approx(550.0)
    assert stats["p50_ms"] == pytest.approx(550.0)
    assert stats["p90_ms"] == pytest.approx(910.0)  # linear interpolation between 900 and 1000
    assert stats["p99_ms"] == pytest.approx(991.0)
    assert stats["min_ms"] == pytest.approx(100.0) and stats["max_ms"] == pytest.approx(1000.0)
    assert clients.latency_stats([None]) == {"count": 0}


def test_underruns_none_when_chunks_arrive_in_time():
    # playback 1.0 -> 2.0 -> 3.0 -> 3.5; chunks arrive before the previous audio runs out
    assert clients.playback_underruns([1.0, 1.9, 2.0, 2.99], [1.0, 1.0, 0.5, 0.5]) == (0, 0.0)


def test_underruns_counted_and_playback_resumes_at_arrival():
    # chunk 1 arrives at 1.5 after playback ended at 1.2 (stall 0.3), then plays 1.5 -> 2.5;
    # chunk 2 at 2.5 is exactly in time; chunk 3 at 3.0 after 2.7 (stall 0.3)
    count, stall = clients.playback_underruns([1.0, 1.5, 2.5, 3.0, 3.1], [0.2, 1.0, 0.2, 0.1, 0.0])
    assert count == 2 and stall == pytest.approx(0.6)


def test_underruns_ignore_empty_chunks_and_check_lengths():
    assert clients.playback_underruns([0.5, 5.0, 5.1], [1.0, 0.0, 1.0]) == (1, pytest.approx(3.6))
    assert clients.playback_underruns([], []) == (0, 0.0)
    with pytest.raises(InvalidInputError):
        clients.playback_underruns([1.0], [])


def test_request_result_chunk_latencies():
    r = clients.RequestResult("u", audio_s=2.0, latency_s=3.0, chunk_arrivals_s=[0.4, 0.9, 2.5],
                              chunk_durations_s=[0.5, 0.5, 1.0])
    assert r.first_chunk_latency_s == 0.4
    assert r.second_chunk_latency_s == pytest.approx(0.5)
    assert r.underruns() == (1, pytest.approx(1.1))  # plays 0.4 -> 1.4, next chunk at 2.5
    d = r.to_dict()
    assert d["underruns"] == 1 and d["first_chunk_latency_s"] == 0.4
    assert clients.RequestResult("v").second_chunk_latency_s is None


def test_summarize_streaming():
    results = [
        clients.RequestResult("a", 2.0, 1.0, [0.1, 0.2], [1.0, 1.0]),
        clients.RequestResult("b", 1.0, 2.0, [0.3, 1.5], [0.5, 0.5]),  # underrun: 1.5 > 0.8
        clients.RequestResult("c", error="boom"),
    ]
    s = clients.summarize(results, wall_s=1.5, mode="streaming")
    assert s["requests"] == 3 and s["failed"] == 1
    assert s["audio_s"] == 3.0 and s["rtf"] == pytest.approx(0.5)
    assert s["latency"]["avg_ms"] == pytest.approx(1500.0)
    assert s["first_chunk_latency"]["p50_ms"] == pytest.approx(200.0)
    assert s["second_chunk_latency"]["max_ms"] == pytest.approx(1200.0)
    assert s["underruns"] == {"total": 1, "requests_with_underrun": 1, "stall_s": pytest.approx(0.7)}
    text = clients.format_summary(s)
    assert "RTF: 0.5000" in text and "playback underruns: 1 in 1 requests" in text
    offline = clients.summarize(results[:1], wall_s=1.0, mode="offline")
    assert "first_chunk_latency" not in offline and "underruns" not in offline


def test_stats_delta_subtracts_counters_only():
    def model(name, n, ns, batches):
        return {"name": name, "version": "1", "last_inference": str(n * 1000), "inference_count": str(n),
                "execution_count": str(n),
                "inference_stats": {"success": {"count": str(n), "ns": str(ns)}, "queue": {"count": str(n), "ns": "7"}},
                "batch_stats": [{"batch_size": bs, "compute_infer": {"count": str(c), "ns": str(c * 10)}}
                                for bs, c in batches]}

    before = {"model_stats": [model("tts", 2, 100, [("1", 2)]), model("idle", 5, 50, [])]}
    after = {"model_stats": [model("tts", 5, 400, [("1", 3), ("2", 2)]), model("idle", 5, 50, []),
                             model("new", 1, 9, [("1", 1)])]}
    delta = clients.stats_delta(before, after)
    names = [m["name"] for m in delta["model_stats"]]
    assert names == ["tts", "new"]  # idle did nothing during the run
    tts = delta["model_stats"][0]
    assert tts["inference_count"] == 3 and tts["execution_count"] == 3
    assert tts["inference_stats"]["success"] == {"count": 3, "ns": 300}
    assert tts["inference_stats"]["queue"] == {"count": 3, "ns": 0}
    assert tts["version"] == "1" and tts["last_inference"] == "5000"
    assert tts["batch_stats"] == [{"batch_size": "1", "compute_infer": {"count": 1, "ns": 10}},
                                  {"batch_size": "2", "compute_infer": {"count": 2, "ns": 20}}]
    text = clients.format_triton_stats(delta)
    assert "model tts (version 1): 3 inferences in 3 executions" in text
    assert "batch size 2   executed 2" in text
    assert clients.format_triton_stats({"model_stats": []}).startswith("no inferences")
