"""deploy/: the Dockerfiles, docker-compose.yaml, Prometheus and Grafana provisioning, and the Kubernetes manifests
parse, name files that exist, and pass `pagedllm serve` only flags (and --config files) pagedllm's parser takes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.deploy.deploy_utils import (
    DEPLOY,
    DOCKERFILE_INSTRUCTIONS,
    dockerfile_instructions,
    exec_form,
    parse_serve_args,
    promql_metric_names,
)
from tests.entrypoints.server_utils import REPO_ROOT

PYPROJECT = (REPO_ROOT / "pyproject.toml").read_text()


def load_yaml_docs(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs), path
    return docs


def entrypoint(path: Path) -> list[str]:
    [(_, arguments)] = [i for i in dockerfile_instructions(path) if i[0] == "ENTRYPOINT"]
    return exec_form(arguments)


# ------------------------------------------------------------------------------------------- Dockerfiles


@pytest.mark.parametrize(
    "name, base, torch_index",
    [
        ("Dockerfile", r"nvidia/cuda:\$\{CUDA_VERSION\}-runtime-", "/whl/cu"),
        ("Dockerfile.cpu", "python:", "/whl/cpu"),
    ],
)
def test_dockerfile(name, base, torch_index):
    path = DEPLOY / name
    instructions = dockerfile_instructions(path)
    for word, arguments in instructions:
        assert word in DOCKERFILE_INSTRUCTIONS, f"{name}: unknown instruction {word}"
        assert arguments, f"{name}: {word} without arguments"
    words = [w for w, _ in instructions]
    assert set(words[: words.index("FROM")]) <= {"ARG"}
    [from_args] = [a for w, a in instructions if w == "FROM"]
    assert re.match(base, from_args), from_args
    runs = " ".join(a for w, a in instructions if w == "RUN")
    args = " ".join(a for w, a in instructions if w == "ARG")
    assert "pip install torch --index-url ${TORCH_INDEX_URL}" in runs and torch_index in args
    # pagedllm installed from the build context (the repository root) with its structured-output extra.
    assert 'pip install ".[structured]"' in runs and re.search(r"^structured = \[", PYPROJECT, re.M)
    for word, arguments in instructions:
        if word == "COPY":
            *sources, _ = arguments.split()
            for source in sources:
                assert (REPO_ROOT / source).exists(), f"{name}: COPY {source}: no such file in the repository"
    # The image runs `pagedllm serve` (the project's console script) with flags pagedllm takes.
    command = entrypoint(path)
    assert command[:2] == ["pagedllm", "serve"]
    assert 'pagedllm = "pagedllm.entrypoints.cli:main"' in PYPROJECT
    args = parse_serve_args(command[2:])
    assert args.host == "0.0.0.0" and args.port == 8000
    assert any(w == "EXPOSE" and a.split()[0] == "8000" for w, a in instructions)


# ---------------------------------------------------------------------------------------------- compose


def compose_mounts(service: dict) -> dict[str, Path]:
    """In-container path -> the file or directory here that a bind mount puts there."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            host = (DEPLOY / source).resolve()
            assert host.exists(), f"compose mounts {source}, which does not exist"
            out[target] = host
    return out


def mounted(mounts: dict[str, Path], container_path: str) -> Path:
    for target, host in mounts.items():
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return host / Path(container_path).relative_to(target) if container_path != target else host
    raise AssertionError(f"nothing is mounted at {container_path}")


def test_compose_server_prometheus_grafana():
    [compose] = load_yaml_docs(DEPLOY / "docker-compose.yaml")
    services = compose["services"]
    assert {"pagedllm", "prometheus", "grafana"} <= set(services)
    server = services["pagedllm"]
    dockerfile = (DEPLOY / server["build"]["context"] / server["build"]["dockerfile"]).resolve()
    assert dockerfile == DEPLOY / "Dockerfile"
    # The container runs the image's entrypoint followed by `command`: one `pagedllm serve` command line.
    args = parse_serve_args(entrypoint(dockerfile)[2:] + server["command"], compose_mounts(server))
    assert args.config == "/config/serve.yaml" or args.config.endswith("serve.yaml")
    assert args.model and args.host == "0.0.0.0"
    published = [int(p.split(":")[-1]) for p in server["ports"]]
    assert args.port in published
    assert "/health" in " ".join(server["healthcheck"]["test"])

    # Prometheus scrapes the server's /metrics by its service name and port.
    prometheus = services["prometheus"]
    prom_config = mounted(compose_mounts(prometheus), "/etc/prometheus/prometheus.yml")
    [config] = load_yaml_docs(prom_config)
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "pagedllm"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"pagedllm:{args.port}"]

    # Grafana: a provisioned Prometheus datasource and a dashboard provider whose folder holds the dashboard.
    grafana = services["grafana"]
    mounts = compose_mounts(grafana)
    provisioning = mounted(mounts, "/etc/grafana/provisioning")
    [datasources] = load_yaml_docs(provisioning / "datasources" / "prometheus.yaml")
    [source] = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert any(p.endswith(":9090") for p in prometheus["ports"])
    [providers] = load_yaml_docs(provisioning / "dashboards" / "pagedllm.yaml")
    [provider] = providers["providers"]
    dashboards = mounted(mounts, provider["options"]["path"])
    dashboard = json.loads((dashboards / "pagedllm.json").read_text())
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert mounted(mounts, home) == dashboards / "pagedllm.json"
    uids = {
        t["datasource"]["uid"] for p in dashboard["panels"] for t in [p, *p["targets"]] if "datasource" in t
    }
    assert uids == {source["uid"]}


def test_dashboard_panels():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "pagedllm.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for name in (
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hits_total",
        "generation_tokens_total",
        "spec_decode_num_accepted_tokens_total",
    ):
        assert f"pagedllm:{name}" in exprs, name
    for bucket in re.findall(r"pagedllm:\w+_bucket", exprs):
        assert re.search(rf"histogram_quantile\(0\.\d+, sum by \(le\) \(rate\({bucket}\{{", exprs), bucket
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_promql_metric_names():
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(pagedllm:a_bucket{model_name=~"$m"}[$__rate_interval]))) '
        "/ ignoring(x) 1 + sum without (y) (pagedllm:b) and on(z) up offset 5m"
    )
    assert promql_metric_names(expr) == {"pagedllm:a_bucket", "pagedllm:b", "up"}
    assert promql_metric_names("label_values(pagedllm:c, model_name)") == {"pagedllm:c"}


# ------------------------------------------------------------------------------------------- Kubernetes


def k8s_objects() -> dict[str, dict]:
    objects = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in load_yaml_docs(path):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path
            key = f"{doc['kind']}/{doc['metadata']['name']}"
            assert key not in objects, key
            objects[key] = doc
    return objects


def test_kubernetes_manifests(tmp_path):
    objects = k8s_objects()
    deployment = objects["Deployment/pagedllm"]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    [container] = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    # --config points at a ConfigMap's file: write it here and parse the container's command line with it.
    files = {}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for mount in container["volumeMounts"]:
        config_map = volumes[mount["name"]].get("configMap")
        if config_map:
            for key, text in objects[f"ConfigMap/{config_map['name']}"]["data"].items():
                (tmp_path / key).write_text(text)
                files[f"{mount['mountPath']}/{key}"] = tmp_path / key
    dockerfile_entrypoint = entrypoint(DEPLOY / "Dockerfile")
    args = parse_serve_args(dockerfile_entrypoint[2:] + container["args"], files)
    assert args.config is not None and args.model
    assert ports["http"] == args.port
    assert pod["spec"]["terminationGracePeriodSeconds"] > args.shutdown_timeout

    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in ports, probe

    service = objects["Service/pagedllm"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert all(p["targetPort"] in ports for p in service["spec"]["ports"])

    monitor = objects["PodMonitor/pagedllm"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"


def test_hpa_scales_on_waiting_requests():
    from pagedllm.metrics import PrometheusStatLogger
    from tests.deploy.deploy_utils import exposition_series

    objects = k8s_objects()
    hpa = objects["HorizontalPodAutoscaler/pagedllm"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert f"{target['kind']}/{target['name']}" in objects
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] in ("Pods", "External")
    spec = metric[metric["type"].lower()]
    name = spec["metric"]["name"]
    assert spec["target"]["type"] == "AverageValue" and float(spec["target"]["averageValue"]) > 0

    # prometheus-adapter turns an exported series into that metric name.
    exported = exposition_series(PrometheusStatLogger("m").render().decode())
    [adapter] = [o for o in objects.values() if o["metadata"]["name"].startswith("prometheus-adapter")]
    [rules] = [yaml.safe_load(text)["rules"] for text in adapter["data"].values()]
    produced = {}
    for rule in rules:
        series = re.match(r"'?([A-Za-z_:][\w:]*)", rule["seriesQuery"]).group(1)
        assert series in exported, series
        renamed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
        produced[renamed] = series
    assert produced.get(name) == "pagedllm:num_requests_waiting"
