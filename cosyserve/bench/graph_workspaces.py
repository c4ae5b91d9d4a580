"""Whether two CUDA graphs of cuBLAS GEMMs corrupt each other when replayed at once on two streams,
captured on one stream (as ``torch.cuda.graph`` does without a stream: they then share one cuBLAS
workspace) or each on a stream of its own (:func:`~cosyserve.runtime.role_stream`, as the engine
captures its graph families).

Each graph computes a few GEMMs of the LLM's decode and prefill sizes (small rows over a long inner
dimension is where cuBLAS splits K into its workspace). Each is replayed alone first for its
expected output, then both are replayed together ``rounds`` times, each on its own stream, and every
output that differs from the expected one counts as corrupted. A replay of the same graph on the
same inputs computes the same thing, so outputs are compared exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime import role_stream

# (rows, inner, outer) of the GEMMs in each graph: a Qwen2-0.5B decode step's MLP and a prefill's.
SHAPES = ((8, 4864, 896), (8, 896, 4864), (1024, 896, 4864))


@dataclass
class Corruption:
    capture: str  # "one stream" | "a stream each"
    rounds: int
    corrupted: int  # replays, of 2 x rounds, whose output differs from the graph's alone


def _graph(stream: torch.cuda.Stream | None, seed: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(seed)
    inputs = [(torch.randn(m, k, generator=g, device=device, dtype=torch.float16),
               torch.randn(k, n, generator=g, device=device, dtype=torch.float16)) for m, k, n in SHAPES]

    def run() -> list[torch.Tensor]:
        return [a @ b for a, b in inputs]

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()  # cuBLAS handles and heuristics, outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outputs = run()
    return graph, outputs


def measure(rounds: int, device: torch.device) -> list[Corruption]:
    results = []
    for capture in ("one stream", "a stream each"):
        streams = ((None, None) if capture == "one stream"
                   else (role_stream(device, "check:a"), role_stream(device, "check:b")))
        graphs = [_graph(stream, seed, device) for seed, stream in enumerate(streams)]
        expected = []
        for graph, outputs in graphs:
            graph.replay()
            torch.cuda.synchronize(device)
            expected.append([out.clone() for out in outputs])
        replay_streams = [torch.cuda.Stream(device) for _ in graphs]
        corrupted = 0
        for _ in range(rounds):
            for (graph, _), stream in zip(graphs, replay_streams):
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    graph.replay()
            for stream in replay_streams:
                torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            corrupted += sum(any(not torch.equal(out, want) for out, want in zip(outputs, wants))
                             for (_, outputs), wants in zip(graphs, expected))
        results.append(Corruption(capture, rounds, corrupted))
    return results
