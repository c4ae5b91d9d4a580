"""The server's ``cosyserve_*`` metrics, read from a Prometheus text page (Triton's metrics port)."""

from __future__ import annotations

import http.client
import math
import sys
import urllib.request
from typing import Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PREFIX = "cosyserve_"


def cosyserve_samples(text: str) -> Iterator[Sample]:
    """The ``cosyserve_*`` samples of a Prometheus text page, each with its labels; raises
    ValueError on a malformed page."""
    for family in text_string_to_metric_families(text):
        yield from (s for s in family.samples if s.name.startswith(PREFIX))


def parse_prometheus(text: str) -> dict[str, float]:
    """The ``cosyserve_*`` samples of a Prometheus text page, each name's value summed over its label
    sets (a model's instances, models sharing a metric); other metrics and non-finite values are
    skipped, and a malformed page gives {}."""
    totals: dict[str, float] = {}
    try:
        for sample in cosyserve_samples(text):
            if math.isfinite(sample.value):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except ValueError:
        return {}
    return totals


def metrics_address(text: str) -> tuple[int, str]:
    """``HOST:PORT`` (or ``:PORT``, ``PORT``) of a metrics page as (port, host), the argument order of
    :func:`scrape_metrics`."""
    host, _, port = text.rpartition(":")
    return int(port), host or "127.0.0.1"


def read_page(port: int, host: str = "localhost", timeout: float = 10.0) -> str:
    """The text of ``http://host:port/metrics``; raises OSError (URLError, HTTPError, timeouts) or
    http.client.HTTPException when it cannot be read."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as response:
        return response.read().decode("utf-8", errors="replace")


def read_metrics(port: int, host: str = "localhost", timeout: float = 10.0) -> dict[str, float]:
    """:func:`parse_prometheus` of the server's page; raises when it cannot be read."""
    return parse_prometheus(read_page(port, host, timeout))


def scrape_metrics(port: int, host: str = "localhost", timeout: float = 5.0) -> dict[str, float]:
    """The server's ``cosyserve_*`` metrics (:func:`parse_prometheus`); {} and a warning when the page
    cannot be read, so that a metrics hiccup costs the breakdown, not the benchmark."""
    try:
        return read_metrics(port, host, timeout)
    except (OSError, http.client.HTTPException) as e:
        print(f"warning: could not read http://{host}:{port}/metrics: {e}", file=sys.stderr, flush=True)
        return {}


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each counter (``*_total``) in both scrapes grew by; {} when either scrape is empty."""
    return {name: after[name] - before[name] for name in after if name.endswith("_total") and name in before}


def first_chunk_stage_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds per stage of the first chunks traced between two scrapes (the front doors'
    ``cosyserve_first_chunk_<stage>_seconds`` counters, :data:`~cosyserve.engine.request.FIRST_CHUNK_STAGES`);
    {} when none was."""
    grew = counter_deltas(before, after)
    count = grew.get("cosyserve_first_chunks_traced_total", 0)
    if not count:
        return {}
    prefix, suffix = "cosyserve_first_chunk_", "_seconds_total"
    return {name[len(prefix):-len(suffix)]: round(1e3 * value / count, 2) for name, value in grew.items()
            if name.startswith(prefix) and name.endswith(suffix)}
