"""The soak's plan and memory arithmetic (cosyserve.bench.soak); the soak itself runs against a
real server in tests/test_faults.py."""

from cosyserve.bench.soak import BAD_INPUTS, MemorySample, SoakConfig, least_squares_slope, memory_trend, plan, run_soak
from cosyserve.errors import is_overload


def test_the_plan_has_the_fractions_asked_in_a_seeded_order():
    config = SoakConfig(requests=200, cancel_fraction=0.1, bad_fraction=0.05, seed=3)
    kinds = plan(config)
    assert (kinds.count("cancel"), kinds.count("bad"), kinds.count("valid")) == (20, 10, 170)
    assert kinds == plan(config) and kinds != plan(SoakConfig(requests=200, seed=4))
    assert kinds[:config.warmup].count("bad") >= len(BAD_INPUTS), "one bad input of each kind in the warm-up"


def test_the_slope_is_per_1000_requests_after_the_warm_up():
    # 2 MB per request after the warm-up, a jump of 100 MB during it
    samples = [MemorySample(0, 0, {"tritonserver": 10.0, "llm_0_0": 100.0}, None),
               MemorySample(1, 10, {"tritonserver": 10.0, "llm_0_0": 200.0}, 5.0)]
    samples += [MemorySample(2 + i, 20 + 10 * i, {"tritonserver": 10.0, "llm_0_0": 200.0 + 20 * i}, 5.0)
                for i in range(5)]
    slopes, growth = memory_trend(samples, warmup=20)
    assert round(slopes["llm_0_0"]) == round(slopes["total"]) == round(slopes["stubs"]) == 2000
    assert abs(slopes["tritonserver"]) < 1e-6 and abs(slopes["gpu"]) < 1e-6
    assert growth["total"] == 80


def test_one_point_has_no_slope():
    assert least_squares_slope([5, 5], [1, 2]) is None


def test_a_soak_for_a_time_sends_nothing_once_its_time_is_up():
    # duration 0: every request finds its time up before it is sent (nothing listens on port 9)
    config = SoakConfig(url="127.0.0.1:9", http_port=9, metrics_port=9, requests=40, duration_s=0.0, burst_every=0)
    report = run_soak(config)
    assert report.outcomes == {} and report.admitted == 0 and report.seconds < 5


def test_every_refusal_for_capacity_reads_as_one_and_nothing_else_does():
    for message in ("[StatusCode.UNAVAILABLE] Exceeds maximum queue size", "Request timeout expired",
                    "overloaded: a stream on this server has 0.12 s of audio buffered, under the 0.3 s it keeps "
                    "for every stream (admission_min_buffer_s); retry after 180 ms",
                    "the token2wav state pool is full (200 pages, 0 freed from unused voices); retry later"):
        assert is_overload(message), message
    for message in ("unknown speaker id 'x'", "text is empty", "request timed out after 5 s", "internal error"):
        assert not is_overload(message), message
