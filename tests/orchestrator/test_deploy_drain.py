"""The deploy files let a drain act (docs/service.md, "Drains and spot"): no `ray stop` in a preStop hook,
a termination grace period longer than the drain's deadline, spot and on-demand worker groups labelled
ray.io/market-type; the cluster launcher's file validates against Ray's own schema. And they are closed:
Ray's token authentication on, the dashboard (the job server) on the head's own address rather than
0.0.0.0, etcd reached over HTTPS with its credentials from Secrets (docs/security.md)."""

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


def uncommented(path: str) -> str:
    with open(path) as f:
        return "\n".join(line.split("#", 1)[0] for line in f)


def test_rayjob_turns_on_ray_token_auth_and_binds_the_dashboard_to_the_head_pods_ip():
    with open("deploy/rayjob.yaml") as f:
        job = yaml.safe_load(f)
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "etrain-ray-token"}
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "$(MY_POD_IP)"
    (container,) = head["template"]["spec"]["containers"]
    pod_ip = [e for e in container["env"] if e["name"] == "MY_POD_IP"]
    assert pod_ip == [{"name": "MY_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    for probe in ("readinessProbe", "livenessProbe"):  # KubeRay's default ones ask localhost:8265
        assert "http://$MY_POD_IP:8265/" in " ".join(container[probe]["exec"]["command"]), probe
    assert "0.0.0.0" not in uncommented("deploy/rayjob.yaml")


def test_rayjob_reaches_etcd_over_https_with_its_credentials_from_secrets():
    with open("deploy/rayjob.yaml") as f:
        job = yaml.safe_load(f)
    assert "--store etcds://" in job["spec"]["entrypoint"]
    cluster = job["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"]
                                                             for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        (c,) = pod["containers"]
        assert {"secretRef": {"name": "etrain-etcd", "optional": True}} in c["envFrom"], c["name"]
        assert not any(e["name"].startswith("ETRAIN_ETCD_") for e in c.get("env", [])), "credentials inline"
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["etcd-ca"] == "/etc/etrain/etcd-ca"
        assert {"name": "etcd-ca", "secret": {"secretName": "etrain-etcd-ca", "optional": True}} in pod["volumes"]


def test_the_cluster_launcher_file_turns_on_ray_token_auth_on_every_node():
    with open("deploy/ray-cluster.yaml") as f:
        cfg = yaml.safe_load(f)
    starts = [c for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2 and all("RAY_AUTH_MODE=token ray start" in c for c in starts)
    (head,) = [c for c in cfg["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in head  # reached through `ray dashboard`'s SSH tunnel, which ends there
    assert "0.0.0.0" not in uncommented("deploy/ray-cluster.yaml")
    assert cfg["file_mounts"]["/home/ray/.ray/auth_token"] == "~/.ray/auth_token"  # Ray's default token path
    assert "echo 'export RAY_AUTH_MODE=token' >> ~/.bashrc" in cfg["setup_commands"]


def test_the_etcd_deploy_texts_say_how_credentials_and_tls_are_given():
    for path in ("deploy/etcd/README.md", "deploy/etcd/docker-compose.yml"):
        with open(path) as f:
            text = f.read()
        for needed in ("ETRAIN_ETCD_USER", "ETRAIN_ETCD_PASSWORD", "ETRAIN_ETCD_CA", "etcds://",
                       "ETRAIN_ETCD_INSECURE"):
            assert needed in text, (path, needed)
        assert "cannot serve as its store" not in text and "without authentication:" not in text
