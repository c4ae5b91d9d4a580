"""Benchmarks: the top layer, beside :mod:`cosyserve.serving`.

It may import serving, pipeline and everything below; only scripts and tests import it.

* :mod:`.prometheus` – the server's ``cosyserve_*`` metrics from its Prometheus page;
* :mod:`.workload` – the synthetic prompt set (seed-tts' wenetspeech4tts split, in shape);
* :mod:`.openloop` – Poisson arrivals and a sender that keeps to them;
* :mod:`.api_load` – open-loop load on the OpenAI-compatible speech API (``scripts/bench_api.py``);
* :mod:`.runner` – one benchmark of Triton server variants: build, serve, measure levels and rates;
* :mod:`.breakdown` – where a level's time went: Triton statistics and the server's counters;
* :mod:`.targets` – the performance targets and their checks;
* :mod:`.report` – tables, ``bench.md`` and ``bench.png``;
* :mod:`.performance` – docs/performance.md from the committed reports in docs/perf/;
* :mod:`.token2wav` – token2wav alone over the engine's kinds (``token2wav.py``: every model, offline and streaming).
"""


class BenchError(RuntimeError):
    """A variant, level or offline run could not be measured (the message says why)."""
