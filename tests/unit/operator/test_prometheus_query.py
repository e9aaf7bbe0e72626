"""The Prometheus signal is the operator's query, not the tenant's: the built-in template of the
job's metric over the job's own series (values escaped as PromQL strings), a job's own PromQL
only where the operator allows it, and a URL whose `#`/`?`/user info would change what is sent
refused whatever the prefixes."""

from __future__ import annotations

import datetime as dt

import pytest
from test_chart_scrape_settings import HELM, operator_env, render
from test_operator_autoscaler import parsed

from rlhf_api.autoscale import PrometheusSource, ScrapeSource, metric_def
from rlhf_operator import autoscaler

PROM = "http://prom:9090"
#: A tenant's query reading every tenant's series (what status.autoscaling.signal would echo).
NOSY = 'max(rlhf_rollout_wait_fraction{namespace!="{namespace}"})'


def test_the_operator_sends_the_built_in_template_over_the_jobs_own_series() -> None:
    src = autoscaler.metric_source(parsed(prometheus={"url": PROM}), prometheus_prefixes=[PROM])
    assert isinstance(src, PrometheusSource)
    want = metric_def("rollout_wait_fraction").promql.replace("{job}", "j").replace("{namespace}", "ns")
    assert src.query == want and 'rlhf_job="j",namespace="ns"' in src.query


def test_a_jobs_own_query_is_refused_unless_the_operator_allows_it() -> None:
    job = parsed(prometheus={"url": PROM, "query": NOSY})
    src = autoscaler.metric_source(job, prometheus_prefixes=[PROM])
    assert isinstance(src, ScrapeSource)  # the job's own controller pod, never the tenant's PromQL
    refused = autoscaler.refusal(job, [PROM])
    assert refused is not None and refused.startswith("spec.autoscaling.prometheus.query is not allowed")
    assert "RLHF_OPERATOR_PROMETHEUS_CUSTOM_QUERIES" in refused
    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    (cond,) = autoscaler.refusal_conditions([], refused, now) or []
    assert (cond["type"], cond["status"], cond["reason"]) == ("PrometheusRefused", "True", "QueryNotAllowed")
    allowed = autoscaler.metric_source(job, prometheus_prefixes=[PROM], custom_queries=True)
    assert isinstance(allowed, PrometheusSource) and allowed.query == NOSY.replace("{namespace}", "ns")
    assert autoscaler.refusal(job, [PROM], custom_queries=True) is None


@pytest.mark.parametrize(
    "url",
    [
        f"{PROM}/#",
        f"{PROM}/prometheus#x",
        f"{PROM}/?query=up",
        "http://user@prom:9090",
        "http://u:p@prom:9090/",
    ],
)
def test_a_url_that_would_change_the_request_is_refused(url: str) -> None:
    assert not autoscaler.prometheus_url_allowed(url, [PROM])
    assert autoscaler.refusal(parsed(prometheus={"url": url}), [PROM]) is not None


def test_values_are_escaped_as_promql_strings() -> None:
    assert autoscaler.promql_string('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    assert autoscaler.promql_string("grpo-run-1") == "grpo-run-1"


@pytest.mark.parametrize(("raw", "want"), [("", False), ("false", False), ("true", True), ("TRUE", True)])
def test_the_setting(raw: str, want: bool) -> None:
    assert autoscaler.custom_queries_allowed({autoscaler.PROMETHEUS_CUSTOM_QUERIES_ENV: raw}) is want


def test_a_bad_setting_names_it() -> None:
    with pytest.raises(ValueError, match="RLHF_OPERATOR_PROMETHEUS_CUSTOM_QUERIES='yes' is not valid"):
        autoscaler.custom_queries_allowed({autoscaler.PROMETHEUS_CUSTOM_QUERIES_ENV: "yes"})


@pytest.mark.skipif(HELM is None, reason="helm not built yet (tests/cluster/build caches it)")
def test_the_chart_value_reaches_the_operator() -> None:
    assert not autoscaler.custom_queries_allowed(operator_env(render()))
    assert autoscaler.custom_queries_allowed(operator_env(render("autoscaler.allowCustomQueries=true")))
