"""Node quarantine without Ray (orchestrator/service/quarantine.py, nodes.py, capacity.py): the document and
its schema (a hostile or corrupt one refused whole, never overwritten, never stopping the allocator), the
bounds a run's quarantines keep to, the admin's release by a unique prefix, the allocator's capacity, view,
state and gauge, the label selector placement uses, and `etrain nodes release/limits` on a store
(docs/operations.md#node-quarantine). The same on a real Ray cluster: tests/orchestrator/test_quarantine_ray.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from orchestrator.service import auth
from orchestrator.service.allocator import AllocatorCore
from orchestrator.service.capacity import free_workers, usable_workers
from orchestrator.service.nodes import quarantine_on_cluster
from orchestrator.service.quarantine import (
    MAX_EVIDENCE_BYTES,
    QUARANTINE_DOC,
    CorruptQuarantine,
    QuarantineRefused,
    UnknownNode,
    avoiding,
    bounded_evidence,
    limits_of,
    quarantine_event,
    quarantine_node,
    quarantined_nodes,
    release_all,
    release_node,
    set_limits,
)
from orchestrator.service.rules import default_policy
from orchestrator.store.cluster_names import cluster_key
from orchestrator.store.run_store import open_store
from tests.orchestrator.test_allocator_hostile import make_run

A, B, C, D = ("a" * 56, "aaaa" + "c" * 52, "b" * 56, "0123" + "f" * 52)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def store(tmp_path):
    return open_store(f"file://{tmp_path}/service")


@pytest.fixture
def admin(store, tmp_path, monkeypatch):
    """The store's admin token (made here, kept in this test's ETRAIN_HOME)."""
    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(auth.ADMIN_TOKEN_ENV, raising=False)
    with open(auth.new_admin_token(store)) as f:
        return f.read().strip()


def put_raw(store, raw: str) -> None:
    _, version = store.read_versioned(None, QUARANTINE_DOC)
    assert store.write_if(None, QUARANTINE_DOC, raw, version)


# --- the document ----------------------------------------------------------------------------


def test_a_quarantine_is_recorded_once_with_its_evidence(store):
    assert quarantined_nodes(store) == {}
    assert quarantine_node(store, A, reason="sdc: digest mismatch", run="tiny.3f2a9c1d", rank=1, step=120,
                           evidence={"mismatches": 3, "ratio": float("nan")}, nodes=8, now=1000.0) is True
    assert quarantine_node(store, A, reason="again", run="other", nodes=8) is False, "idempotent"
    entry = quarantined_nodes(store)[A]
    assert entry == {"reason": "sdc: digest mismatch", "since": 1000.0, "run": "tiny.3f2a9c1d", "rank": 1,
                     "step": 120, "evidence": {"mismatches": 3, "ratio": "nan"}, "address": None}
    for bad, kw in ((ValueError, {"node_id": "n-b"}), (ValueError, {"reason": " "}), (ValueError, {"rank": -1}),
                    (ValueError, {"step": True}), (ValueError, {"run": "../x"})):
        with pytest.raises(bad):
            quarantine_node(store, **{"node_id": B, "reason": "sdc", "nodes": 8, **kw})


def test_evidence_is_bounded_keys_in_order_then_truncated():
    big = {f"k{i:03d}": "x" * 100 for i in range(100)}
    kept = bounded_evidence(big)
    assert kept["truncated"] is True and "k000" in kept and "k099" not in kept
    assert len(json.dumps(kept)) <= MAX_EVIDENCE_BYTES
    assert bounded_evidence({"t": (1, 2), "o": object}) == {"t": [1, 2], "o": str(object)}
    assert bounded_evidence(None) == {}


@pytest.mark.parametrize("raw", [
    "not json", "[1, 2]", '{"nodes": []}', '{"nodes": {"n-b": {"reason": "x", "since": 1}}}',
    '{"nodes": {"%s": {"since": 1}}}' % A, '{"nodes": {"%s": {"reason": "x", "since": NaN}}}' % A,
    '{"nodes": {"%s": {"reason": "x", "since": 1, "rank": -1}}}' % A,
    '{"nodes": {"%s": {"reason": "x", "since": 1, "evidence": {"e": "%s"}}}}' % (A, "y" * 3000),
    '{"nodes": {"%s": {"reason": "x", "since": 1, "run": "\\u001b[31m"}}}' % A,
    '{"nodes": {}, "limits": {"max_fraction": 2}}', '{"nodes": {}, "limits": {"per_run": "all"}}',
    "[" * 100000,
])
def test_a_document_that_is_not_etrains_is_refused_whole_and_never_overwritten(store, admin, raw):
    put_raw(store, raw)
    with pytest.raises(CorruptQuarantine, match="etrain nodes release --all"):
        quarantined_nodes(store)
    with pytest.raises(CorruptQuarantine):
        quarantine_node(store, B, reason="sdc", nodes=8)
    assert store.read_versioned(None, QUARANTINE_DOC)[0] == raw, "a quarantine never overwrites what it cannot read"
    assert release_all(store, admin) == -1  # the repair
    assert quarantined_nodes(store) == {}


def test_unknown_fields_are_left_out_and_the_limits_kept(store):
    put_raw(store, json.dumps({"nodes": {A: {"reason": "x", "since": 1, "extra": [1]}}, "limits": {"per_run": 3},
                               "future": 1}))
    assert quarantined_nodes(store)[A]["reason"] == "x" and "extra" not in quarantined_nodes(store)[A]
    assert limits_of(store).per_run == 3


# --- bounds ---------------------------------------------------------------------------------


def test_quarantines_take_at_most_a_fraction_of_the_cluster(store):
    assert quarantine_node(store, A, reason="sdc", run="r1", nodes=8)
    assert quarantine_node(store, B, reason="sdc", run="r2", nodes=8)
    with pytest.raises(QuarantineRefused, match=r"2 of the cluster's 8 nodes are already.*etrain nodes release"):
        quarantine_node(store, C, reason="sdc", run="r3", nodes=8)
    assert set(quarantined_nodes(store)) == {A, B}
    small = open_store(store.url + "-small")
    assert quarantine_node(small, A, reason="sdc", nodes=2), "at least one node, however small the cluster"
    with pytest.raises(QuarantineRefused):
        quarantine_node(small, B, reason="sdc", nodes=2)


def test_one_run_quarantines_at_most_per_run_nodes(store, admin, tmp_path, monkeypatch):
    for n in (A, B):
        assert quarantine_node(store, n, reason="sdc", run="greedy.12345678", nodes=100)
    with pytest.raises(QuarantineRefused, match=r"run greedy.12345678 holds 2 quarantined nodes.*per_run 2"):
        quarantine_node(store, C, reason="sdc", run="greedy.12345678", nodes=100)
    assert quarantine_node(store, C, reason="sdc", run="another", nodes=100)
    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "elsewhere"))  # not the admin's own token file
    with pytest.raises(auth.NotAuthorized, match="needs the admin token"):
        set_limits(store, "etr_" + "0" * 43, per_run=3)
    assert set_limits(store, admin, per_run=3).per_run == 3
    assert quarantine_node(store, D, reason="sdc", run="greedy.12345678", nodes=100)
    with pytest.raises(Exception, match="--max-fraction"):
        set_limits(store, admin, max_fraction=0)


# --- release -----------------------------------------------------------------------------------


def test_release_needs_the_admin_token_and_takes_a_unique_prefix(store, tmp_path, monkeypatch):
    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(auth.ADMIN_TOKEN_ENV, raising=False)
    for n in (A, B):
        quarantine_node(store, n, reason="sdc", nodes=100)
    with pytest.raises(auth.NotAuthorized, match="has none yet"):
        release_node(store, A)
    with open(auth.new_admin_token(store)) as f:
        admin = f.read().strip()
    with pytest.raises(UnknownNode, match=r"'aaaa' names 2 quarantined nodes \(aaaaaaaaaaaa, aaaacccccccc\)"):
        release_node(store, "aaaa", admin)
    with pytest.raises(UnknownNode, match="give at least 4 hex digits"):
        release_node(store, "aaa", admin)
    with pytest.raises(UnknownNode, match=r"no quarantined node 'ffff'; they are: aaaaaaaaaaaa, aaaacccccccc"):
        release_node(store, "ffff", admin)
    node, entry = release_node(store, "aaaac", admin)
    assert node == B and entry["reason"] == "sdc" and set(quarantined_nodes(store)) == {A}
    assert release_node(store, A.upper(), admin)[0] == A
    with pytest.raises(UnknownNode, match="there is none"):
        release_node(store, A, admin)


# --- what a run's controller calls -------------------------------------------------------------


def test_a_run_quarantines_only_a_node_it_formed_on_while_it_is_live(tmp_path, store):
    runs = open_store(f"file://{tmp_path}/runs")
    make_run(runs, "tiny", workers=2)
    kw = {"reason": "sdc", "run_id": "tiny", "store_url": runs.url, "rank": 1, "step": 7, "store": store, "nodes": 8}
    with pytest.raises(QuarantineRefused, match="never formed a group on it"):
        quarantine_on_cluster(A, **kw)
    runs.add_event("tiny", {"kind": "formed", "world_size": 2, "nodes": [A, C]})
    assert quarantine_on_cluster(A, evidence={"digests": [1, 2]}, **kw) is True
    assert quarantined_nodes(store)[A]["run"] == cluster_key("tiny", runs.url)
    assert quarantine_on_cluster(A, **kw) is False
    make_run(runs, "done", workers=1, phase="FINISHED")
    runs.add_event("done", {"kind": "formed", "nodes": [C]})
    with pytest.raises(QuarantineRefused, match="is FINISHED"):
        quarantine_on_cluster(C, **{**kw, "run_id": "done"})
    assert quarantine_event(A, reason="sdc", rank=1, step=7) == {"kind": "quarantine", "node": A, "reason": "sdc",
                                                                 "rank": 1, "step": 7}
    assert quarantine_event(A, reason="sdc", refused="bound")["refused"] == "bound"


# --- the allocator and placement ----------------------------------------------------------------


class Recording:
    """The default policy, keeping the cluster views it was asked with."""

    name = "recording"

    def __init__(self):
        self.views, self.inner = [], default_policy()

    def decide(self, runs, cluster, now):
        self.views.append(cluster)
        return self.inner.decide(runs, cluster, now)


def test_the_allocator_reads_publishes_and_shows_the_quarantine_and_survives_a_corrupt_one(store):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    make_run(store, "good", workers=1, max_workers=1, phase="QUEUED", world=0)
    published, policy = [], Recording()
    core = AllocatorCore(store, capacity=lambda cpw, gpw: 3, policy=policy, publish=published.append)
    core.register("good", store.url)
    quarantine_node(store, A, reason="fail-slow", nodes=8)
    core.tick()
    assert policy.views[-1].quarantined == {A: "fail-slow"} and set(published[-1]) == {A}
    assert core.last["quarantined"] == [A] and store.get_spec("good").target == 1
    reg = CollectorRegistry(auto_describe=False)
    reg.register(core.metrics)
    samples = {s.name: s.value for f in text_string_to_metric_families(generate_latest(reg).decode())
               for s in f.samples}
    assert samples["etrain_quarantined_nodes"] == 1
    put_raw(store, '{"nodes": {"x": 1}}')  # corrupt: the last set read stands, and the decision is made
    core.tick()
    assert core.last["quarantined"] == [A] and set(published[-1]) == {A}


def test_capacity_leaves_quarantined_and_draining_nodes_out():
    nodes = [{"NodeID": A, "Alive": True, "Resources": {"CPU": 4.0}},
             {"NodeID": B, "Alive": True, "Resources": {"CPU": 4.0, "GPU": 2.0}},
             {"NodeID": C, "Alive": False, "Resources": {"CPU": 4.0}},
             {"NodeID": D, "Alive": True, "Resources": {"CPU": 2.0}}]
    assert usable_workers(nodes, "CPU", 2.0) == 5
    assert usable_workers(nodes, "CPU", 2.0, frozenset({A})) == 3
    assert usable_workers(nodes, "GPU", 1.0, frozenset({A, D})) == 2
    assert usable_workers(nodes, "GPU", 1.0, frozenset({B})) == 0
    assert free_workers(7.0, [3.0], 2.0) == 2 and free_workers(1.0, [3.0], 1.0) == 0


def test_the_label_selector_keeps_off_the_quarantined_nodes():
    assert avoiding({}, []) == {}
    assert avoiding({"ray.io/market-type": "spot"}, {C, A}) == {"ray.io/market-type": "spot",
                                                                "ray.io/node-id": f"!in({A},{C})"}
    from ray._private.label_utils import validate_label_selector

    assert validate_label_selector(avoiding({}, [A, B, C])) is None, "a selector Ray takes"
    assert avoiding({"ray.io/node-id": A}, [C]) == {"ray.io/node-id": A}, "a selector of its own on the id stands"


# --- the command line ------------------------------------------------------------------------------

PROBE = textwrap.dedent("""
    import json, sys
    from orchestrator.cli.main import main
    codes = [main(args) for args in json.loads(sys.argv[1])]
    print(json.dumps({"codes": codes, "heavy": sorted(m for m in ("torch", "ray") if m in sys.modules)}))
""")


def test_etrain_nodes_release_and_limits_on_a_store_without_the_cluster(store, admin, tmp_path):
    quarantine_node(store, A, reason="sdc", nodes=8)
    quarantine_node(store, B, reason="sdc", nodes=8)
    s = ["--store", store.url]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", auth.ADMIN_TOKEN_ENV)}
    env.update(PYTHONPATH=ROOT, ETRAIN_HOME=str(tmp_path / "home"))
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps([
        ["nodes", "release", "aaaa", *s], ["nodes", "release", "aaaac", *s], ["nodes", "limits", "--per-run", "3", *s],
        ["nodes", "limits", "--json", *s], ["nodes", "release", *s], ["nodes", "release", A, *s],
        ["nodes", "release", "--all", *s], ["nodes", *s], ["nodes", "limits", "--per-run", "0", *s]])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["codes"] == [2, 0, 0, 0, 2, 0, 0, 2, 2], (out, r.stderr)
    assert out["heavy"] == [], "release and limits on a store load neither torch nor Ray"
    assert "names 2 quarantined nodes" in r.stderr and f"node {B} released" in r.stdout
    assert '"per_run": 3' in r.stdout and "needs a NODE" in r.stderr and "released 0 quarantined nodes" in r.stdout
    assert "--address HEAD:6379" in r.stderr and "--per-run 0 must be" in r.stderr
    assert quarantined_nodes(store) == {} and limits_of(store).per_run == 3
