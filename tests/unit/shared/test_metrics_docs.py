"""docs/metrics.md lists exactly the metrics the code declares (names, types, labels), both ways."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from device_agent.metrics import METRICS as DEVICE
from fed_server.metrics import METRICS as FED
from main_server.metrics import METRICS as MAIN
from shared.http_metrics import HTTP_METRICS

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(?P<name>[a-z_:]+)` \| (?P<type>\w+) \| (?P<labels>[^|]*) \|")
UNITS = ("_seconds", "_bytes", "_ratio")


def documented() -> dict[str, dict[str, tuple[str, tuple[str, ...]]]]:
    """Section title -> metric name -> (type, labels), from the tables of docs/metrics.md."""
    sections: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {}
    current = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            current = line[3:].split(" (")[0].strip()
            sections[current] = {}
            continue
        m = ROW.match(line)
        if m and current is not None:
            labels = tuple(re.findall(r"`([a-z_]+)`", m["labels"]))
            assert m["name"] not in sections[current], f"{m['name']} documented twice"
            sections[current][m["name"]] = (m["type"], labels)
    return sections


def as_dict(specs) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {s.name: (s.type, s.labels) for s in specs}


@pytest.mark.parametrize("section, specs", [
    ("Fed Server", [s for s in FED if s not in HTTP_METRICS]),
    ("Main Server", [s for s in MAIN if s not in HTTP_METRICS]),
    ("Both servers", list(HTTP_METRICS)),
    ("Device agent", list(DEVICE)),
])
def test_docs_match_code_both_ways(section, specs):
    docs = documented()[section]
    code = as_dict(specs)
    assert sorted(set(code) - set(docs)) == [], f"declared in code but not documented in {DOC.name} ({section})"
    assert sorted(set(docs) - set(code)) == [], f"documented in {DOC.name} ({section}) but not declared in code"
    for name in code:
        assert docs[name] == code[name], f"{name}: docs say {docs[name]}, code says {code[name]}"


def test_both_servers_export_the_http_metrics():
    assert set(HTTP_METRICS) <= set(FED) and set(HTTP_METRICS) <= set(MAIN)


@pytest.mark.parametrize("spec", [*FED, *MAIN, *DEVICE], ids=lambda s: s.name)
def test_prometheus_naming_conventions(spec):
    assert re.fullmatch(r"sfl_(fed|main|device|http)_[a-z0-9_]+", spec.name)
    assert spec.type in ("counter", "gauge", "histogram")
    if spec.type == "counter":
        assert spec.name.endswith("_total")
    else:
        assert not spec.name.endswith("_total")
    if spec.type == "histogram" and spec.name != "sfl_main_group_label_distance":
        assert spec.name.endswith("_seconds"), "latency histograms are in seconds"
    if "seconds" in spec.name or "bytes" in spec.name:
        assert spec.name.removesuffix("_total").endswith(UNITS), "the unit ends the name"
    assert "le" not in spec.labels and "quantile" not in spec.labels
    assert spec.help


def test_only_fed_server_and_agent_use_device_labels():
    """Bounded cardinality: the Main Server and the HTTP counters carry no device or group id."""
    for spec in (*MAIN, *HTTP_METRICS):
        assert not {"device", "device_id", "group", "group_id", "path", "round"} & set(spec.labels), spec.name
    allowed = {"device", "phase", "status", "state", "split_point", "candidate", "direction", "route", "deadline", "stat"}
    for spec in (*FED, *MAIN, *DEVICE):
        assert set(spec.labels) <= allowed, spec.name
