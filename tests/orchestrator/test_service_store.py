"""A shared cluster's service store on a real Ray cluster on 127.0.0.1 (the session's): `etrain service init`
records it in Ray's GCS, `etrain grant` and `etrain quota` act there only, and a run asking more than its
owner's grant is refused before it starts, recording nothing (docs/service.md#a-shared-cluster)."""

from __future__ import annotations

import json

import pytest

from checkpointing.errors import ConfigError
from orchestrator.cli.main import main as etrain
from orchestrator.store.run_store import open_store
from trainer.config.load import load_raw

BASE = ["data.max_bytes=200000", "data.seq_len=16", "train.global_batch=12", "train.micro_batch=1", "train.steps=4"]


@pytest.fixture
def service(ray_cluster, tmp_path, monkeypatch):
    """The session's cluster with a service store of its own for this test, forgotten after it (the allocator
    of later tests' runs must not see its grants)."""
    from ray.experimental import internal_kv

    from orchestrator.service.grants import KV_KEY, KV_NAMESPACE

    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))
    url = f"file://{tmp_path}/service"
    try:
        yield url, ray_cluster.cluster.address
    finally:
        internal_kv._internal_kv_del(KV_KEY, namespace=KV_NAMESPACE)
        svc = open_store(url)
        _, version = svc.read_versioned(None, "service")
        svc.write_if(None, "service", "{}", version)  # no longer a service store: its grants apply nowhere


@pytest.mark.ray
def test_service_init_grants_and_a_run_refused_before_it_starts(service, tmp_path, capsys):
    from orchestrator.driver.run import prepare_run_doc
    from orchestrator.service.grants import service_url

    url, address = service
    # This process is joined to the session's cluster: another address is refused, never recorded here.
    assert etrain(["service", "init", "--store", url, "--address", "127.0.0.1:1"]) == 2
    assert "not the cluster this process is connected to" in capsys.readouterr().err and service_url() is None
    assert etrain(["service", "init", "--store", url, "--address", address]) == 0
    out = capsys.readouterr().out
    assert "is the cluster's service store" in out and "admin token" in out
    assert service_url() == url
    assert etrain(["service", "show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["service"] and shown["admin"] and shown["grants"] == {}

    runs = f"file://{tmp_path}/runs"
    raw = load_raw("examples/tiny.toml", [*BASE, "elastic.priority=5", "elastic.team=vision"])
    with pytest.raises(ConfigError) as refused:
        prepare_run_doc(raw, run_id="greedy", store=runs, owner="ana")
    assert "elastic.priority = 5" in str(refused.value) and "max_priority 0" in str(refused.value)
    assert "elastic.team = 'vision'" in str(refused.value)
    assert open_store(runs).list_runs() == [], "a refused run is not recorded"

    # A tenant's own store is not where grants or quotas are changed.
    other = f"file://{tmp_path}/mine"
    assert etrain(["quota", "default", "--max-workers", "0", "--store", other]) == 2
    assert "not the cluster's service store" in capsys.readouterr().err
    assert etrain(["grant", "ana", "--max-priority", "5", "--teams", "vision"]) == 0  # the admin's token file
    assert etrain(["grant", "--list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["grants"]["ana"] == {
        "max_priority": 5, "teams": ["vision"], "nonpreemptible": False}
    spec, _ = prepare_run_doc(raw, run_id="granted", store=runs, owner="ana")
    assert spec.sharing.priority == 5 and open_store(runs).list_runs() == ["granted"]


@pytest.mark.ray
def test_two_stores_runs_of_one_id_run_side_by_side(ray_cluster, tmp_path):
    """The allocator's registry, the autoscaler's demand and the controller actor's name were keyed by run id
    alone: a second tenant's `twin` replaced the first's (its controller's name was taken)."""
    from tests.cluster import start_run

    a, store_a = start_run(f"file://{tmp_path}/ana", "train.steps=6", workers=1, max_workers=1, run_id="twin")
    b, store_b = start_run(f"file://{tmp_path}/bo", "train.steps=6", workers=1, max_workers=1, run_id="twin")
    final_a, final_b = a.join(300), b.join(300)
    assert final_a["phase"] == final_b["phase"] == "FINISHED", (final_a, final_b)
    assert store_a.get_status("twin")["step"] == store_b.get_status("twin")["step"] == 6
