"""Open-loop load: requests arrive at seeded Poisson times, however many are still in flight.

Production traffic arrives this way. A closed loop of N senders sends only when one of its requests
has finished, so it never has more than N in flight and slows down with the server; an open loop
keeps arriving, so a server that cannot keep up queues, and its latencies and stalls show it.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

from ..errors import InvalidInputError

Result = TypeVar("Result")


def poisson_arrivals(rate: float, seed: int, *, count: int | None = None,
                     duration_s: float | None = None) -> list[float]:
    """Arrival times (seconds since the start) of a Poisson process of ``rate`` requests a second:
    the first at 0, then exponential gaps of mean 1 / rate. Either ``count`` arrivals, or every
    arrival before ``duration_s``. The gaps are one seeded unit-rate sequence divided by ``rate``,
    so that every rate of one seed has the same pattern of bursts, compressed or stretched."""
    if not rate > 0:
        raise InvalidInputError(f"the arrival rate must be > 0 requests a second, got {rate}")
    if (count is None) == (duration_s is None):
        raise InvalidInputError("give either a number of arrivals or a duration")
    if count is not None and count < 1:
        raise InvalidInputError(f"at least one arrival, got {count}")
    if duration_s is not None and not duration_s > 0:
        raise InvalidInputError(f"the duration must be > 0 s, got {duration_s}")
    rng = random.Random(seed)
    arrivals, unit_time = [], 0.0
    while count is None or len(arrivals) < count:
        if duration_s is not None and unit_time / rate >= duration_s:
            break
        arrivals.append(unit_time / rate)
        unit_time += rng.expovariate(1.0)
    return arrivals


@dataclass
class OpenLoopRun(Generic[Result]):
    results: list[Result]  # in arrival order
    start_lags_s: list[float]  # how late each request started against its arrival time
    peak_in_flight: int  # most requests in flight at once
    wall_s: float  # the start to the end of the last request

    def summary(self, arrivals_s: Sequence[float], rate: float) -> dict:
        """The open loop's own numbers (JSON): the rate asked for and the one offered, the peak in
        flight and how late the sender was (a late sender would hide queueing)."""
        span = arrivals_s[-1] - arrivals_s[0]
        return {"arrival_rate": rate, "requests": len(arrivals_s),
                "offered_req_per_s": (len(arrivals_s) - 1) / span if span > 0 else None,
                "arrivals_s": list(arrivals_s), "peak_in_flight": self.peak_in_flight,
                "start_lag_max_ms": 1e3 * max(self.start_lags_s), "wall_s": self.wall_s}


def run_open_loop(arrivals_s: Sequence[float], send: Callable[[int], Result]) -> OpenLoopRun[Result]:
    """Call ``send(i)`` on a thread of its own ``arrivals_s[i]`` seconds after the start, whatever is
    still in flight, and wait for every call. ``send`` should turn a failed request into its result;
    an exception it raises anyway is raised here after every call has ended."""
    if list(arrivals_s) != sorted(arrivals_s):
        raise InvalidInputError("arrival times must not decrease")
    results: list = [None] * len(arrivals_s)
    lags = [0.0] * len(arrivals_s)
    errors: list[BaseException] = []
    lock = threading.Lock()
    in_flight = peak = 0

    def call(i: int) -> None:
        nonlocal in_flight
        try:
            results[i] = send(i)
        except BaseException as e:  # raised after every call has ended
            errors.append(e)
        finally:
            with lock:
                in_flight -= 1

    threads = []
    start = time.perf_counter()
    for i, arrival in enumerate(arrivals_s):
        if (wait := start + arrival - time.perf_counter()) > 0:
            time.sleep(wait)
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        lags[i] = time.perf_counter() - start - arrival
        thread = threading.Thread(target=call, args=(i,), name=f"arrival-{i}")
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return OpenLoopRun(results, lags, peak, wall)
