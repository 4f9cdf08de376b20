"""The dashboards (dashboards/*.json) and alert rules (dashboards/alerts.yaml) against a real Prometheus scraping a
real mesh.

One mesh for the module: `radixmesh serve --enable-metrics --metrics-sd-file ...` with prefill/decode
disaggregation (a prefill and a decode worker, Mooncake over TCP), the hierarchical cache and the kvstore as its L3
tier over the Mooncake transfer engine, so every family the dashboards read exists: worker latencies and load, cache
tiers, PD transfers and queues, router traffic per worker, the tokenizer and the kvstore. Debian's `prometheus`
scrapes every target the launcher lists (file_sd) every second and evaluates the rules. Traffic includes a bad
request, so the error series exist too.

Then, through Prometheus's HTTP API: every target is up; every panel query of both dashboards (Grafana variables
replaced by concrete values) returns data; every alert rule evaluates without error, and each side of its top-level
comparisons (`X / Y > 0.05` -> `X / Y`; `A > 10 and B > 0` -> `A`, `B`; numbers dropped) returns data, since a
healthy mesh fires nothing and an empty condition says nothing about whether the rule reads live series; and every
metric name either file names is one Prometheus has scraped (so the `or ... * 0` fallbacks of the error ratios do not
hide a misspelt error metric)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from radixmesh.services.launch import free_port
from tests.conftest import ROOT, model_path
from tests.e2e.mesh import http_get, launch, stop_and_check

pytest.importorskip("mooncake.engine", reason="needs the Mooncake transfer engine (mooncake-transfer-engine)")

DASHBOARDS = ROOT / "dashboards"
RULES = DASHBOARDS / "alerts.yaml"
BOARDS = ("radixmesh.json", "pd-and-kvstore.json")
SERVED = "tiny"
SCRAPE_S = 1
# Grafana's variables as the test fills them in: the served model, and a rate window spanning the whole test.
VARIABLES = {"model_name": re.escape(SERVED), "__rate_interval": "5m", "__interval": "15s", "__range": "5m"}
OUR_METRIC = re.compile(r"(?<![\w:])((?:sglang:|radixmesh:|sgl_router_)[\w:]*|up)(?![\w:])")
MESH_FLAGS = ("--disaggregation", "pd", "--disaggregation-transfer-backend", "mooncake", "--kvstore",
              "--kvstore-transport", "mooncake", "--enable-hierarchical-cache", "--hicache-ratio", "4",
              "--page-size", "4", "--served-model-name", SERVED, "--enable-metrics")


# ---- Prometheus ------------------------------------------------------------------------------------------------
class Prometheus:
    def __init__(self, port: int, proc: subprocess.Popen, log: Path):
        self.url, self.proc, self.log = f"http://127.0.0.1:{port}", proc, log

    def api(self, path: str, **params: str) -> dict:
        status, body = http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        out = json.loads(body)
        assert status == 200 and out["status"] == "success", f"{path} {params}: {status} {body[:300]!r}"
        return out["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def wait(self, what: str, ok, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()[-2000:]}")
            if result := ok():
                return result
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}; targets: {self.target_states()}")

    def target_states(self) -> list:
        """What Prometheus says of each target (for a failure's message)."""
        try:
            return [(t["labels"].get("service"), t["health"], t["lastScrape"], t["lastError"])
                    for t in self.api("targets")["activeTargets"]]
        except Exception as e:  # noqa: BLE001 - a diagnostic must not hide the failure it explains
            return [f"unavailable: {e!r}"]


def start_prometheus(tmp: Path, sd_file: Path) -> Prometheus:
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s",
                   "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "radixmesh",
                            "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "1s"}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port, log = free_port(), tmp / "prometheus.log"
    proc = subprocess.Popen([shutil.which("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    prom = Prometheus(port, proc, log)
    try:
        prom.wait("prometheus ready", lambda: _answers(f"{prom.url}/-/ready"))
    except BaseException:
        stop_prometheus(prom)
        raise
    return prom


def _answers(url: str) -> bool:
    try:
        return http_get(url, timeout=2)[0] == 200
    except OSError:
        return False


def stop_prometheus(prom: Prometheus) -> None:
    prom.proc.terminate()
    try:
        prom.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        prom.proc.kill()
        prom.proc.wait()


# ---- traffic ---------------------------------------------------------------------------------------------------
def post(mesh, path: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(f"{mesh.url}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def send_traffic(mesh, tag: str) -> None:
    """Plain and streamed generations over a shared prefix (cache hits), a chat completion, and one bad request."""
    prefix = "The lighthouse keeper opened the logbook and wrote about the storm, the ship and the long night; "
    for i in range(3):
        status, body = post(mesh, "/generate", {"text": prefix + f"{tag} entry {i}.",
                                               "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
        assert status == 200, body[:300]
    status, body = post(mesh, "/v1/completions", {"model": SERVED, "prompt": prefix + f"{tag} stream",
                                                  "max_tokens": 8, "stream": True, "temperature": 0})
    assert status == 200 and b"data: [DONE]" in body, body[:300]
    status, body = post(mesh, "/v1/chat/completions", {"model": SERVED, "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": prefix + tag}]})
    assert status == 200, body[:300]
    status, body = post(mesh, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}})
    assert status == 400, body[:300]  # the decode worker refuses it: a router error and a worker error


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    if shutil.which("prometheus") is None:
        pytest.skip("needs Debian's prometheus package (make apt-deps installs it)")
    tmp = tmp_path_factory.mktemp("prometheus")
    sd_file = tmp / "targets.json"
    mesh = launch(model_path("tiny-llama"), tmp, *MESH_FLAGS, "--metrics-sd-file", str(sd_file))
    prometheus = None
    try:
        # complete once the mesh is ready (the launcher's own target once came a moment after "ready")
        listed = {g["labels"]["service"] for g in json.loads(sd_file.read_text())}
        assert {"launcher", "router", "tokenizer", "kvstore"} <= listed, listed
        # Labelled series (per route, worker, method, error type) appear with their first event: a first round
        # creates them before Prometheus's first scrape, so the rates below see the second round's increases.
        send_traffic(mesh, "warm-up")
        prometheus = start_prometheus(tmp, sd_file)
        targets = json.loads(sd_file.read_text())
        prometheus.wait("every target scraped", lambda: len(prometheus.query("up")) == len(targets))
        send_traffic(mesh, "measured")
        sent = time.time()
        prometheus.wait("two scrapes after the traffic", lambda: all(
            float(s["value"][1]) > sent + SCRAPE_S for s in prometheus.query("timestamp(up)")))
        prometheus.wait("every rule group evaluated after the traffic", lambda: _evaluated_after(prometheus, sent))
        yield prometheus, targets
    finally:
        if prometheus is not None:
            stop_prometheus(prometheus)
        stop_and_check(mesh)


def _evaluated_after(prom: Prometheus, t: float) -> bool:
    """Every rule group was evaluated after time `t` (the API reports RFC 3339 times; compare whole seconds)."""
    for group in prom.api("rules")["groups"]:
        stamp = group.get("lastEvaluation", "")[:19]
        if not stamp or datetime.fromisoformat(stamp + "+00:00").timestamp() < int(t) + 1:
            return False
    return True


# ---- reading the files -----------------------------------------------------------------------------------------
def load_board(name: str) -> dict:
    return json.loads((DASHBOARDS / name).read_text())


def panels(board: dict) -> list[dict]:
    """Every panel, rows' nested panels included, rows themselves left out."""
    out = []
    for p in board["panels"]:
        out += panels(p) if p["type"] == "row" else [p]
    return out


def fill(expr: str) -> str:
    """Grafana's variables replaced: ${name}, ${name:regex} and $name."""
    for name, value in VARIABLES.items():
        expr = re.sub(r"\$\{%s(?::\w+)?\}|\$%s\b" % (name, name), lambda _: value, expr)
    assert "$" not in expr, f"an unknown variable in {expr}"
    return expr


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


_COMPARISON = re.compile(r"\b(?:and|or|unless)\b|==|!=|>=|<=|>|<")


def sides(expr: str) -> list[str]:
    """The operands of the top-level `and`/`or`/`unless` and comparison operators of a PromQL expression (outside
    any (), {}, [] or string), numbers dropped: the condition with its thresholds taken off."""
    cuts, depth, i, quote = [], 0, 0, None
    while i < len(expr):
        c = expr[i]
        if quote:
            quote = None if c == quote else quote
            i += 2 if c == "\\" else 1
            continue
        if c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and (m := _COMPARISON.match(expr, i)):
            cuts.append((m.start(), m.end()))
            i = m.end()
            continue
        i += 1
    parts, start = [], 0
    for a, b in cuts + [(len(expr), len(expr))]:
        parts.append(re.sub(r"^\s*bool\b", "", expr[start:a]).strip())
        start = b
    return [p for p in parts if p and not re.fullmatch(r"[-+]?[\d.eE+]+", p)]


def every_expr() -> list[tuple[str, str]]:
    """(where, expression) for each panel target, variable query and rule."""
    out = []
    for name in BOARDS:
        board = load_board(name)
        out += [(f"{name}: {p['title']} [{t['refId']}]", t["expr"]) for p in panels(board) for t in p["targets"]]
        out += [(f"{name}: variable {v['name']}", v["definition"]) for v in board["templating"]["list"]
                if v["type"] == "query"]
    return out + [(f"alerts.yaml: {r['alert']}", r["expr"]) for r in rules()]


# ---- static checks ---------------------------------------------------------------------------------------------
def test_promtool_checks_the_rules():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs Debian's prometheus package (promtool)")
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


def test_rules_have_severity_for_and_annotations():
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names))
    for r in rules():
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        assert "for" in r and r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        assert sides(r["expr"]), r["alert"]


@pytest.mark.parametrize("name", BOARDS)
def test_dashboard_is_a_grafana_model(name):
    board = load_board(name)
    assert board["schemaVersion"] >= 36 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query" and variables["model_name"]["includeAll"]
    every = [p for p in board["panels"]] + [q for p in board["panels"] for q in p.get("panels", [])]
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels(board):
        where = f"{name}: {p['title']}"
        assert p["type"] in ("timeseries", "stat", "gauge", "bargauge", "table", "heatmap"), where
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert p["fieldConfig"]["defaults"]["unit"], f"{where}: no unit"
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, where
        assert p["targets"], f"{where}: no targets"
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), where
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == p["datasource"], where
            if "rate(" in t["expr"]:
                assert "[$__rate_interval]" in t["expr"], f"{where}: rates use $__rate_interval"


def test_grafana_provisioning_files():
    ds = yaml.safe_load((DASHBOARDS / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["apiVersion"] == 1 and ds["datasources"][0]["type"] == "prometheus"
    prov = yaml.safe_load((DASHBOARDS / "provisioning" / "dashboards" / "radixmesh.yaml").read_text())
    assert prov["apiVersion"] == 1 and prov["providers"][0]["type"] == "file"
    assert prov["providers"][0]["options"]["path"]


def test_sides_of_a_condition():
    assert sides('up{service=~"worker.*"} == 0') == ['up{service=~"worker.*"}']
    assert sides('(a or b) / c{x!="y>1"} > 0.05') == ['(a or b) / c{x!="y>1"}']
    assert sides("q > 10\nand deriv(q[10m]) > 0") == ["q", "deriv(q[10m])"]
    assert sides("x > bool 1e3") == ["x"]


# ---- against the live mesh -------------------------------------------------------------------------------------
def test_every_target_is_up(prom):
    prometheus, targets = prom
    active = prometheus.api("targets")["activeTargets"]
    assert {t["labels"]["service"] for t in active} == {g["labels"]["service"] for g in targets}
    assert {"router", "tokenizer", "kvstore", "worker-prefill-0", "worker-decode-0"} <= {
        g["labels"]["service"] for g in targets}
    down = [(t["labels"]["service"], t["lastError"]) for t in active if t["health"] != "up"]
    assert not down, down
    assert all(float(s["value"][1]) == 1 for s in prometheus.query("up"))


def test_every_dashboard_query_returns_data(prom):
    prometheus, _ = prom
    empty = []
    for name in BOARDS:
        for p in panels(load_board(name)):
            for t in p["targets"]:
                if not prometheus.query(fill(t["expr"])):
                    empty.append(f"{name}: {p['title']} [{t['refId']}]: {t['expr']}")
    assert not empty, "panel queries without data:\n" + "\n".join(empty)


def test_dashboard_variables_resolve(prom):
    prometheus, _ = prom
    for name in BOARDS:
        for v in load_board(name)["templating"]["list"]:
            if v["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["definition"])
            assert m, v["definition"]
            values = prometheus.api(f"label/{m[2]}/values", **{"match[]": m[1]})
            assert SERVED in values, f"{name}: {v['name']} offers {values}"


def test_every_alert_rule_evaluates_on_live_series(prom):
    prometheus, _ = prom
    loaded = {r["name"]: r for g in prometheus.api("rules")["groups"] for r in g["rules"]}
    problems = []
    for r in rules():
        state = loaded.get(r["alert"])
        if state is None or state["health"] != "ok":
            problems.append(f"{r['alert']}: not evaluated cleanly ({state and state.get('lastError')})")
            continue
        prometheus.query(r["expr"])  # the whole condition is valid PromQL (empty while healthy)
        problems += [f"{r['alert']}: no data for {side}" for side in sides(r["expr"]) if not prometheus.query(side)]
    assert not problems, "\n".join(problems)


def test_every_metric_named_has_been_scraped(prom):
    prometheus, _ = prom
    scraped = set(prometheus.api("label/__name__/values"))
    missing = {(where, name) for where, expr in every_expr() for name in OUR_METRIC.findall(expr)
               if name not in scraped}
    assert not missing, sorted(missing)
