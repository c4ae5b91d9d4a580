"""Whether two CUDA graphs of cuBLAS GEMMs corrupt each other when replayed at once on two streams,
captured on one stream (as ``torch.cuda.graph`` does without a stream: they then share one cuBLAS
workspace) or each on a stream of its own (:func:`~cosyserve.runtime.role_stream`, as the engine
captures its graph families).

Each graph computes a few GEMMs of the LLM's decode and prefill sizes (small rows over a long inner
dimension is where cuBLAS splits K into its workspace). Each is replayed alone first for its
expected output, then both are replayed together ``rounds`` times, each on its own stream. A replay
is corrupted when an output is off its expected value by more than :data:`CORRUPTED_REL_L2`; the
largest deviation of any replay is reported too. (Outputs were first compared exactly: on an H100
6,000 and 5,998 of 6,000 replays differed from the graph's alone, captured on one stream and on a
stream each, by amounts not recorded. Reductions that are not reproducible bit for bit differ by
rounding; another GEMM's partial sums in the workspace would be off by the order of the values.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime import role_stream

# (rows, inner, outer) of the GEMMs in each graph: a Qwen2-0.5B decode step's MLP and a prefill's.
SHAPES = ((8, 4864, 896), (8, 896, 4864), (1024, 896, 4864))
# rel-L2 from the output alone past which a replay's output is corrupted, not rounded differently
CORRUPTED_REL_L2 = 1e-2


@dataclass
class Corruption:
    capture: str  # "one stream" | "a stream each"
    rounds: int
    corrupted: int  # replays, of 2 x rounds, with an output off by more than CORRUPTED_REL_L2
    worst_rel_l2: float  # the largest rel-L2 of any output from the graph's alone


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
        corrupted, worst = 0, 0.0
        for _ in range(rounds):
            for (graph, _), stream in zip(graphs, replay_streams):
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    graph.replay()
            for stream in replay_streams:
                torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            for (_, outputs), wants in zip(graphs, expected):
                errors = [float((out.float() - want.float()).norm() / want.float().norm())
                          for out, want in zip(outputs, wants)]
                corrupted += max(errors) > CORRUPTED_REL_L2
                worst = max(worst, *errors)
        results.append(Corruption(capture, rounds, corrupted, worst))
    return results
