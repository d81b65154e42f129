"""DaemonMetrics scraped over real HTTP and parsed with prometheus_client's own parser."""

from __future__ import annotations

import math

import pytest
import requests
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from xcluster.errors import ConfigError, HandoffError
from xcluster.follow.handoff import HandoffResult
from xcluster.follow.metrics import SECONDS_BUCKETS, DaemonMetrics


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def scrape(server) -> dict[str, dict]:
    """metric family name -> {"type": ..., "samples": {(sample name, sorted labels): value}}"""
    text = requests.get(server.url, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = {"type": family.type,
                            "samples": {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}}
    return out


def value(families, family, sample=None, **labels):
    return families[family]["samples"][(sample or family, tuple(sorted(labels.items())))]


def test_a_daemon_lifecycle_is_visible_in_a_scrape():
    clock = Clock(1_000.0)
    m = DaemonMetrics(clock=clock)
    m.set_info(source="s3://bucket/run", engine="vllm")
    m.set_engine_state("loading")
    m.fetched(1_500, 0.2)
    m.fetched(500, 3.0)
    m.apply_seconds.observe(0.004)
    m.write_dir_seconds.observe(12.0)
    m.version_applied(7, committed_at=990.0, head_version=9)
    m.handoff_done(HandoffResult(version=7, path="/m/versions/7", seconds=4.0, pause_seconds=3.5, attempts=3,
                                 detail=""))
    m.retry("fetch")
    m.checksum_failure()
    m.handoff_failed(HandoffError("engine refused"))
    m.error(TimeoutError())
    with m.serve(0) as server:
        got = scrape(server)
        clock.now = 1_100.0
        later = scrape(server)

    assert got["xcluster_applied_version"]["type"] == "gauge"
    assert value(got, "xcluster_applied_version") == 7
    assert value(got, "xcluster_versions_behind") == 2
    assert value(got, "xcluster_staleness_seconds") == 10.0
    assert value(later, "xcluster_staleness_seconds") == 110.0  # computed at scrape time
    assert got["xcluster_fetched_bytes"]["type"] == "counter"
    assert value(got, "xcluster_fetched_bytes", "xcluster_fetched_bytes_total") == 2_000
    fetch = "xcluster_fetch_duration_seconds"
    assert got[fetch]["type"] == "histogram"
    assert value(got, fetch, fetch + "_count") == 2
    assert value(got, fetch, fetch + "_sum") == pytest.approx(3.2)
    assert value(got, fetch, fetch + "_bucket", le="0.25") == 1
    assert value(got, fetch, fetch + "_bucket", le="600.0") == 2
    assert value(got, "xcluster_apply_duration_seconds", "xcluster_apply_duration_seconds_bucket", le="0.005") == 1
    assert value(got, "xcluster_write_dir_duration_seconds", "xcluster_write_dir_duration_seconds_count") == 1
    assert value(got, "xcluster_handoff_duration_seconds", "xcluster_handoff_duration_seconds_sum") == 4.0
    assert value(got, "xcluster_engine_pause_duration_seconds",
                 "xcluster_engine_pause_duration_seconds_sum") == 3.5
    assert value(got, "xcluster_retries", "xcluster_retries_total", operation="handoff") == 2
    assert value(got, "xcluster_retries", "xcluster_retries_total", operation="fetch") == 1
    assert value(got, "xcluster_checksum_failures", "xcluster_checksum_failures_total") == 1
    assert value(got, "xcluster_handoff_failures", "xcluster_handoff_failures_total") == 1
    assert value(got, "xcluster_errors", "xcluster_errors_total", type="HandoffError") == 1
    assert value(got, "xcluster_errors", "xcluster_errors_total", type="TimeoutError") == 1
    assert value(got, "xcluster_versions_applied", "xcluster_versions_applied_total") == 1
    assert value(got, "xcluster_handoffs", "xcluster_handoffs_total") == 1
    assert value(got, "xcluster_daemon_info", source="s3://bucket/run", engine="vllm") == 1
    state = "xcluster_engine_state"
    assert value(got, state, xcluster_engine_state="failed") == 1
    assert value(got, state, xcluster_engine_state="serving") == 0


def test_unknown_until_the_first_version():
    m = DaemonMetrics()
    m.head_seen(5)
    with m.serve(0) as server:
        got = scrape(server)
    for name in ("xcluster_applied_version", "xcluster_versions_behind", "xcluster_staleness_seconds"):
        assert math.isnan(value(got, name)), name
    m.version_applied(3, committed_at=0.0)
    m.head_seen(5)
    assert m.registry.get_sample_value("xcluster_versions_behind") == 2


def test_histogram_buckets_span_a_millisecond_to_ten_minutes():
    assert SECONDS_BUCKETS[0] == 0.001 and SECONDS_BUCKETS[-1] == 600
    assert list(SECONDS_BUCKETS) == sorted(SECONDS_BUCKETS)


def test_two_daemons_in_one_process_do_not_clash():
    a, b = DaemonMetrics(), DaemonMetrics()
    a.versions_applied.inc(3)
    assert b.registry.get_sample_value("xcluster_versions_applied_total") == 0
    shared = CollectorRegistry()
    DaemonMetrics(shared)
    with pytest.raises(ValueError):  # prometheus_client refuses duplicate names in one registry
        DaemonMetrics(shared)


def test_shutdown_frees_the_port():
    server = DaemonMetrics().serve(0)
    url = server.url
    assert requests.get(url, timeout=10).status_code == 200
    server.shutdown()
    with pytest.raises(requests.ConnectionError):
        requests.get(url, timeout=2)


def test_bad_arguments():
    m = DaemonMetrics()
    with pytest.raises(ConfigError):
        m.set_engine_state("dancing")
    with pytest.raises(ConfigError):
        m.serve(70_000)
