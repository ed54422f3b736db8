"""The Grafana dashboard in deploy/ reads only metrics that a running `pagedllm serve` exports: every metric name in
its PromQL (histogram ``_bucket`` / ``_sum`` / ``_count`` and counter ``_total`` series included) appears in the
server's /metrics, with the labels the queries match on."""

from __future__ import annotations

import json

import httpx

from tests.deploy.deploy_utils import (
    DEPLOY,
    dashboard_queries,
    exposition_series,
    promql_matcher_labels,
    promql_metric_names,
)


def test_dashboard_queries_name_exported_metrics(server, client, model):
    # One finished request, so that nothing the dashboard reads depends on the server never having served.
    client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
    text = httpx.get(server.base_url + "/metrics", timeout=10.0).text
    exported = exposition_series(text)
    assert "pagedllm:time_to_first_token_seconds_bucket" in exported

    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "pagedllm.json").read_text())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 10
    used: set[str] = set()
    for expr in queries:
        names = promql_metric_names(expr)
        assert names, expr
        missing = sorted(names - set(exported))
        assert not missing, f"{expr}\nreads metrics the server does not export: {missing}"
        used |= names
        for name, labels in promql_matcher_labels(expr).items():
            assert labels <= exported[name], f"{expr}: {name} has no label(s) {labels - exported[name]}"
    suffixes = {name.rsplit("_", 1)[-1] for name in used}
    assert {"bucket", "sum", "count", "total"} <= suffixes
