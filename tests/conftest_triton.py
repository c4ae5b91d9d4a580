"""Helpers for the Triton end-to-end tests: the model repository, a server on free ports, requests.

The repository is built like ``run.sh`` stage 2 (copy ``model_repo/<model>``, fill its
``config.pbtxt`` with scripts/fill_template.py), plus ``cosyvoice2_offline``: the same BLS with
``decoupled: False``, so one server exercises streaming and offline without a second start-up.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import shutil
import socket
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from cosyserve.pipeline.schedule import plan_chunks

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLES_PER_TOKEN = 960
HELD_BACK_SAMPLES = 3840  # HiFT overlap withheld by a non-final chunk (8 mel frames x 480)


def _fill_template_module():
    spec = importlib.util.spec_from_file_location("fill_template", REPO_ROOT / "scripts" / "fill_template.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def template_values(models_dir: Path, *, max_tokens: int, min_tokens: int, bls_instances: int,
                    decoupled: bool = True, max_batch_size: int = 16) -> dict[str, dict[str, str]]:
    """The keys run.sh stage 2 fills, per model."""
    common = {"model_dir": f"{models_dir}/CosyVoice2-0.5B", "triton_max_batch_size": str(max_batch_size),
              "max_queue_delay_microseconds": "0", "device": "cpu"}
    return {
        "token2wav": common, "audio_tokenizer": common, "speaker_embedding": common,
        "llm": {**common, "llm_dir": f"{models_dir}/cosyvoice2_llm"},
        "cosyvoice2": {"model_dir": common["model_dir"], "triton_max_batch_size": str(max_batch_size),
                       "llm_tokenizer_dir": f"{models_dir}/cosyvoice2_llm",
                       "bls_instance_num": str(bls_instances), "decoupled_mode": str(decoupled),
                       "streaming_strategy": "exponential", "llm_model_name": "llm",
                       "max_tokens": str(max_tokens), "min_tokens": str(min_tokens)},
    }


def build_model_repo(models_dir: Path, repo: Path, *, max_tokens: int, min_tokens: int, bls_instances: int) -> Path:
    """Streaming ``cosyvoice2`` + its offline twin ``cosyvoice2_offline`` + the four shared models."""
    fill = _fill_template_module().fill
    shutil.rmtree(repo, ignore_errors=True)
    values = template_values(models_dir, max_tokens=max_tokens, min_tokens=min_tokens, bls_instances=bls_instances)
    offline = {**values["cosyvoice2"], "decoupled_mode": "False"}
    models = [*((m, m, v) for m, v in values.items()), ("cosyvoice2_offline", "cosyvoice2", offline)]
    for name, template, subs in models:
        shutil.copytree(REPO_ROOT / "model_repo" / template, repo / name)
        config = repo / name / "config.pbtxt"
        config.write_text(fill(config.read_text(), subs).replace(f'name: "{template}"', f'name: "{name}"'))
    return repo


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def expected_chunk_samples(num_tokens: int) -> list[int]:
    """Samples per streamed chunk for ``num_tokens`` speech tokens (exponential schedule).

    A non-final chunk voices its hop and withholds the HiFT overlap; the next one delivers it.
    """
    chunks = plan_chunks(num_tokens)
    sizes = []
    for i, chunk in enumerate(chunks):
        voiced = (chunk.num_tokens if chunk.finalize else chunk.num_tokens - 3) - chunk.token_offset
        carried = HELD_BACK_SAMPLES if i > 0 else 0
        withheld = 0 if chunk.finalize else HELD_BACK_SAMPLES
        sizes.append(SAMPLES_PER_TOKEN * voiced + carried - withheld)
    return sizes


def metrics(port: int) -> dict[str, float]:
    """cosyserve_* metrics from Triton's Prometheus endpoint (label-less keys: one model each)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines() if line.startswith("cosyserve_")}


def wait_until_idle(port: int, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll until no LLM request is active and no token2wav stream is open; returns the metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = metrics(port)
        idle = values["cosyserve_llm_active_requests"] == 0 and values["cosyserve_token2wav_open_streams"] == 0
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def grpc_input(name: str, value, datatype: str | None = None) -> grpcclient.InferInput:
    if isinstance(value, str):
        value, datatype = np.array([[value.encode("utf-8")]], dtype=object), "BYTES"
    value = np.asarray(value)
    datatype = datatype or {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.bool_): "BOOL",
                            np.dtype(np.uint64): "UINT64", np.dtype(np.float16): "FP16"}[value.dtype]
    tensor = grpcclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


def token_limits(num_tokens: int) -> list:
    """BLS inputs that make the LLM produce exactly ``num_tokens`` speech tokens."""
    value = np.array([[num_tokens]], np.int32)
    return [grpc_input("max_tokens", value), grpc_input("min_tokens", value)]


class Stream:
    """One gRPC stream to a decoupled model: ``send`` a request, ``responses`` until the final flag."""

    def __init__(self, grpc_url: str):
        self.client = grpcclient.InferenceServerClient(grpc_url)
        self._queue: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self._queue.put((result, error)))

    def send(self, model: str, inputs: list, request_id: str = "", outputs: list[str] = ("waveform",)) -> None:
        self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True,
                                       outputs=[grpcclient.InferRequestedOutput(o) for o in outputs])

    def next(self, timeout_s: float = 120.0):
        """(result, error) of the next response."""
        return self._queue.get(timeout=timeout_s)

    def responses(self, output: str = "waveform", timeout_s: float = 120.0) -> list[np.ndarray]:
        """Every non-empty ``output`` until the final response; raises the stream's error."""
        arrays = []
        while True:
            result, error = self.next(timeout_s)
            if error is not None:
                raise error
            array = result.as_numpy(output)
            if array is not None:
                arrays.append(array)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return arrays

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def server_env() -> dict[str, str]:
    """One torch/OMP thread per model process: the CI machine has 2 cores."""
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
