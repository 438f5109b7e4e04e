"""configs/monitoring/compose.yaml: specserve, Prometheus and Grafana with the data source and the dashboard
provisioned. Everything it mounts or builds exists, Prometheus scrapes the specserve service, Grafana's
data source is the Prometheus service, and the dashboard uses that data source and comes from the folder
the provisioning reads. (That the dashboard's series are ones the server exports:
tests/server/startup/test_configs.py, against a real scrape.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
MONITORING = ROOT / "configs" / "monitoring"
COMPOSE: dict[str, Any] = yaml.safe_load((MONITORING / "compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]


def _mounts(service: str) -> dict[str, Path]:
    """{path in the container: file on this machine} of a service's bind mounts."""
    out = {}
    for volume in SERVICES[service].get("volumes", []):
        source, target, *_ = volume.split(":")
        assert source.startswith("."), f"{service}: {volume} is not a path beside the compose file"
        out[target] = (MONITORING / source).resolve()
    return out


def _mounted(service: str, container_path: str) -> Path:
    mounts = _mounts(service)
    assert container_path in mounts, (service, container_path, sorted(mounts))
    return mounts[container_path]


def _container_port(service: str) -> int:
    (published,) = SERVICES[service]["ports"]
    host, _, container = published.rpartition(":")
    assert host.startswith("127.0.0.1:"), f"{service} is published beyond loopback: {published}"
    return int(container)


def test_everything_mounted_or_built_exists() -> None:
    for service in SERVICES:
        for target, source in _mounts(service).items():
            assert source.is_file(), (service, target, source)
    build = SERVICES["specserve"]["build"]
    context = (MONITORING / build["context"]).resolve()
    assert context == ROOT
    dockerfile = (context / build["dockerfile"]).read_text()
    assert re.search(rf"^FROM \S+ AS {build['target']}$", dockerfile, flags=re.M), build


@pytest.mark.parametrize("service", ["prometheus", "grafana"])
def test_images_are_pinned(service: str) -> None:
    assert re.search(r":v?\d+\.\d+\.\d+$", SERVICES[service]["image"]), SERVICES[service]["image"]


def test_prometheus_scrapes_the_specserve_service() -> None:
    command = SERVICES["specserve"]["command"]
    port = int(command[command.index("--port") + 1])
    assert _container_port("specserve") == port and command[command.index("--host") + 1] == "0.0.0.0"
    config = yaml.safe_load(_mounted("prometheus", "/etc/prometheus/prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"specserve:{port}"]


def _provisioned(kind: str) -> dict[str, Any]:
    (path,) = [p for target, p in _mounts("grafana").items()
               if PurePosixPath(target).parent == PurePosixPath("/etc/grafana/provisioning", kind)]
    return yaml.safe_load(path.read_text())


def _dashboard_datasources(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        found = [node["datasource"]] if isinstance(node.get("datasource"), dict) else []
        return found + [d for v in node.values() for d in _dashboard_datasources(v)]
    if isinstance(node, list):
        return [d for v in node for d in _dashboard_datasources(v)]
    return []


def test_grafana_provisions_the_prometheus_service_and_the_dashboard() -> None:
    (source,) = _provisioned("datasources")["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    assert source["url"] == f"http://prometheus:{_container_port('prometheus')}"

    (provider,) = _provisioned("dashboards")["providers"]
    folder = PurePosixPath(provider["options"]["path"])
    dashboards = [p for target, p in _mounts("grafana").items() if PurePosixPath(target).parent == folder]
    assert dashboards == [ROOT / "configs" / "grafana" / "specserve-dashboard.json"]

    # Provisioned dashboards are not imported, so `__inputs` would never be filled in: the dashboard
    # names its data source through a variable that defaults to the provisioned uid.
    dashboard = json.loads(dashboards[0].read_text())
    assert "__inputs" not in dashboard
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    (name,) = [n for n, v in variables.items() if v["type"] == "datasource"]
    assert variables[name]["query"] == source["type"]
    assert variables[name]["current"]["value"] == source["uid"]
    refs = _dashboard_datasources(dashboard)
    assert len(refs) > 20
    assert all(ref == {"type": source["type"], "uid": f"${{{name}}}"} for ref in refs), refs


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (apt-get install prometheus; .ci/run does this)")
@pytest.mark.parametrize("config", [MONITORING / "prometheus.yml", ROOT / "configs" / "prometheus.yml"],
                         ids=["compose", "local"])
def test_prometheus_accepts_the_scrape_configs(config: Path) -> None:
    proc = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
