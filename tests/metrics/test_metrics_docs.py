"""docs/metrics.md and the Grafana dashboard agree with the metric catalog."""

from __future__ import annotations

import json
import re
from pathlib import Path

from lmkv.metrics import CATALOG

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _table() -> dict[str, tuple[str, tuple[str, ...]]]:
    """{metric: (type, labels)} of the table under "## Every metric"."""
    text = (DOCS / "metrics.md").read_text()
    section = text.split("## Every metric", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0].startswith("`"):
            labels = tuple(x.strip() for x in cells[2].split(",") if x.strip())
            rows[cells[0].strip("`")] = (cells[1], labels)
    return rows


def test_the_metrics_page_documents_every_catalog_metric_as_it_is() -> None:
    documented = _table()
    catalog = {m.name: (m.kind, m.labels) for m in CATALOG}
    assert set(documented) - set(catalog) == set(), "documented, not in the catalog"
    assert set(catalog) - set(documented) == set(), "in the catalog, not documented"
    assert documented == catalog


def test_every_dashboard_expression_names_catalog_metrics() -> None:
    dashboard = json.loads((DOCS / "grafana" / "lmkv.json").read_text())
    names = {m.name for m in CATALOG}
    histograms = {m.name for m in CATALOG if m.kind == "histogram"}
    used = set()
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs
    for expr in exprs:
        found = [m.group(0) for m in re.finditer(r"\$\{prefix\}[a-z_]+\b", expr)]
        assert found, expr
        assert "lmkv_" not in expr, f"a name without the ${{prefix}} variable: {expr!r}"
        for sample in found:
            name = sample.removeprefix("${prefix}")
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if base in histograms:
                name = base
            assert name in names, f"{sample} in {expr!r} is not a catalog metric"
            used.add(name)
    assert histograms <= used  # the latencies have panels
    # One dashboard for both exporters: lmkv's own (lmkv_*) and vllm serve's (vllm:lmkv_*).
    (prefix,) = [v for v in dashboard["templating"]["list"] if v["name"] == "prefix"]
    assert [o["value"] for o in prefix["options"]] == ["lmkv_", "vllm:lmkv_"]
