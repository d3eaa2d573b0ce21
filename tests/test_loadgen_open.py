"""Open-loop arrivals and goodput in `nanoserve.loadgen` (day 43): the send times are a seeded
Poisson process, the open loop sends on schedule however slow the server is, and goodput is
the count of requests that met the objective, per second."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time

import pytest

from nanoserve import loadgen
from nanoserve.loadgen import LoadReport, RequestResult, goodput, poisson_arrivals


def test_arrivals_are_exponential_gaps_from_the_seeded_rng():
    times = poisson_arrivals(5, rate=4.0, seed=7)
    rng = random.Random(7)
    want, t = [], 0.0
    for _ in range(5):
        t += rng.expovariate(4.0)
        want.append(t)
    assert times == want


def test_arrivals_have_the_mean_gap_and_spread_of_a_poisson_process():
    rate, n = 10.0, 20_000
    times = poisson_arrivals(n, rate, seed=0)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert all(g > 0 for g in gaps) and times == sorted(times)
    mean = statistics.fmean(gaps)
    assert abs(mean - 1 / rate) < 0.03 / rate  # 1/rate, within 3% (the sd of the mean is 0.7%)
    assert abs(statistics.pstdev(gaps) / mean - 1) < 0.05  # an exponential's sd equals its mean
    # P(gap <= mean) = 1 - 1/e for an exponential, against 0.5 for an even spacing's jitter
    assert abs(sum(g <= 1 / rate for g in gaps) / n - (1 - math.exp(-1))) < 0.02
    # the count in each 1 s window is Poisson: its variance equals its mean (rate)
    counts = [0] * int(times[-1])
    for t in times:
        if int(t) < len(counts):
            counts[int(t)] += 1
    assert abs(statistics.fmean(counts) - rate) < 0.5
    assert abs(statistics.pvariance(counts) / statistics.fmean(counts) - 1) < 0.15


def test_arrivals_are_reproducible_by_seed():
    assert poisson_arrivals(50, 3.0, seed=1) == poisson_arrivals(50, 3.0, seed=1)
    assert poisson_arrivals(50, 3.0, seed=1) != poisson_arrivals(50, 3.0, seed=2)
    assert poisson_arrivals(0, 3.0) == []
    assert poisson_arrivals(4, math.inf) == [0.0] * 4  # all at once


@pytest.mark.parametrize("rate", [-1.0, 0, 0.0, math.nan, "fast", None])
def test_a_rate_that_is_not_positive_is_refused(rate):
    with pytest.raises(ValueError, match="rate is requests per second and must be more than 0"):
        poisson_arrivals(10, rate)


def test_a_negative_count_is_refused():
    with pytest.raises(ValueError, match="n is a number of requests"):
        poisson_arrivals(-1, 2.0)


def test_closed_loop_refuses_no_clients():
    with pytest.raises(ValueError, match="concurrency is the number of clients"):
        asyncio.run(loadgen.run_load("http://127.0.0.1:9", [], concurrency=0))


def result(ttft, tokens, e2e, finish="length", asked=None):
    return RequestResult(
        asked=tokens if asked is None else asked, tokens=tokens, ttft=ttft, e2e=e2e,
        finish_reason=finish, usage_tokens=tokens,
    )  # fmt: skip


def made_up_report() -> LoadReport:
    """Eight requests over 4 s, made up so that each bound decides some of them."""
    rs = [
        result(0.10, 11, 0.10 + 10 * 0.020),  # 0: TTFT 100 ms, TPOT 20 ms: good
        result(0.30, 11, 0.30 + 10 * 0.020),  # 1: TTFT 300 ms: too slow to start
        result(0.10, 11, 0.10 + 10 * 0.060),  # 2: TPOT 60 ms: too slow to go on
        result(0.20, 11, 0.20 + 10 * 0.050),  # 3: TTFT 200, TPOT 50: on both bounds, good
        result(0.05, 1, 0.05),  # 4: one token, no TPOT: good
        result(0.05, 5, 0.05 + 4 * 0.010, asked=11),  # 5: fast but cut short: incomplete
        RequestResult(asked=11, error="HTTP 429: queue full"),  # 6: refused
        result(0.15, 6, 0.15 + 5 * 0.045),  # 7: good
    ]
    return LoadReport(rs, seconds=4.0, concurrency=8, rate=2.0)


def test_goodput_equals_the_count_by_hand():
    report = made_up_report()
    g = goodput(report, ttft_ms=200, tpot_ms=50)
    assert g["good"] == 4  # requests 0, 3, 4 and 7
    assert g["goodput_req_s"] == 1.0 and g["good_share"] == 0.5
    assert (g["slo_ttft_ms"], g["slo_tpot_ms"]) == (200, 50)
    assert goodput(report, ttft_ms=200)["good"] == 5  # + request 2: its TPOT is not checked
    assert goodput(report, tpot_ms=50)["good"] == 5  # + request 1: its TTFT is not checked
    assert goodput(report, ttft_ms=1000, tpot_ms=1000)["good"] == 6  # every complete request
    assert loadgen.summarize(report)["request_rate"] == 2.0


@pytest.mark.parametrize(
    "kw, match",
    [
        ({}, "at least one bound"),
        ({"ttft_ms": -5}, "ttft_ms is a bound in milliseconds"),
        ({"ttft_ms": 200, "tpot_ms": 0}, "tpot_ms is a bound in milliseconds"),
        ({"tpot_ms": math.nan}, "tpot_ms is a bound"),
    ],
)
def test_goodput_refuses_bounds_that_are_not_bounds(kw, match):
    with pytest.raises(ValueError, match=match):
        goodput(made_up_report(), **kw)


def test_goodput_refuses_a_run_of_no_time():
    with pytest.raises(ValueError, match="goodput is per second"):
        goodput(LoadReport([], 0.0, 0), ttft_ms=100)


def test_closed_loop_report_keeps_its_columns():
    """summarize's keys for a closed loop are what they were before open loops (bench, CSVs)."""
    keys = list(loadgen.summarize(LoadReport([result(0.1, 3, 0.2)], 1.0, 1)))
    assert keys[:2] == ["requests", "concurrency"] and "request_rate" not in keys


def test_open_loop_sends_on_schedule_however_slow_the_server(monkeypatch):
    """No answer comes until all 8 requests have been sent: an open loop sends each at its time
    anyway, so all 8 are in flight at once; a loop that waited for an answer before its next send
    would never finish (the stub's 30 s timeout fails it). Nothing here depends on the machine's
    speed: a busy machine can only send late, never early or out of order."""
    calls, everyone = [], asyncio.Event()

    async def slow_server(client, url, req, headers, model=None):
        calls.append(time.perf_counter())
        if len(calls) == 8:
            everyone.set()
        await asyncio.wait_for(everyone.wait(), timeout=30)
        return result(0.3, req.max_tokens, 0.3)

    monkeypatch.setattr(loadgen, "stream_one", slow_server)
    reqs = [loadgen.LoadRequest(None, 4, [17, 18]) for _ in range(8)]
    report = asyncio.run(loadgen.run_open_loop("http://127.0.0.1:9", reqs, rate=50.0, seed=3))
    want = poisson_arrivals(8, 50.0, seed=3)
    sent = [r.sent_at for r in report.results]
    assert all(s >= w - 1e-3 for s, w in zip(sent, want)), (sent, want)  # none before its time
    assert sent == sorted(sent)  # in the schedule's order
    assert report.concurrency == 8 and report.rate == 50.0  # nobody waited for an answer
    assert len(calls) == 8 and all(r.complete for r in report.results)


def test_open_loop_refuses_a_bad_rate_before_sending():
    with pytest.raises(ValueError, match="rate is requests per second"):
        asyncio.run(loadgen.run_open_loop("http://127.0.0.1:9", [], rate=-2.0))
