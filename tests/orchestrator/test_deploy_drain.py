"""The deploy files let a drain act (docs/service.md, "Drains and spot"): no `ray stop` in a preStop hook,
a termination grace period longer than the drain's deadline, spot and on-demand worker groups labelled
ray.io/market-type; the cluster launcher's file validates against Ray's own schema."""

from __future__ import annotations

import json
import os

import yaml


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_rayjob_worker_pods_drain_before_they_go_and_come_as_spot_and_on_demand():
    with open("deploy/rayjob.yaml") as f:
        job = yaml.safe_load(f)
    groups = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    markets = set()
    for g in groups:
        pod = g["template"]["spec"]
        for c in pod["containers"]:
            pre = json.dumps(c.get("lifecycle", {}).get("preStop", {}))
            assert "ray stop" not in pre, f"group {g['groupName']}: a preStop `ray stop` kills Ray before its drain"
            env = env_of(c)
            drain_s = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
            assert 0 < drain_s < pod["terminationGracePeriodSeconds"], g["groupName"]
            markets.add(env["RAY_NODE_MARKET_TYPE"])
    assert markets == {"spot", "on-demand"}


def test_the_cluster_launcher_file_has_a_spot_node_type_and_is_valid_for_ray():
    import jsonschema
    import ray.autoscaler

    with open("deploy/ray-cluster.yaml") as f:
        cfg = yaml.safe_load(f)
    with open(os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json")) as f:
        jsonschema.validate(cfg, json.load(f))
    types = cfg["available_node_types"]
    spot = [t for t in types.values() if t.get("labels", {}).get("ray.io/market-type") == "spot"]
    assert spot and spot[0]["node_config"]["InstanceMarketOptions"] == {"MarketType": "spot"}
    assert any(t.get("labels", {}).get("ray.io/market-type") == "on-demand" for t in types.values())
