"""The control commands load neither torch nor Ray (nor transformers): `etrain status`, `events`, `suspend`,
`resize`, `stop`, `queue` and `quota` against a file store with a run recorded, each in a fresh interpreter
(importing torch alone takes seconds on a loaded machine; docs/benchmarks.md#control-commands)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from orchestrator.driver.run import prepare_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = textwrap.dedent("""
    import json, sys
    from orchestrator.cli.main import main
    codes = []
    for args in json.loads(sys.argv[1]):
        try:
            codes.append(main(args))
        except SystemExit as e:
            codes.append(e.code)
    heavy = sorted(m for m in ("torch", "ray", "transformers") if m in sys.modules)
    print(json.dumps({"codes": codes, "heavy": heavy}))
""")


def probe(commands: list[list[str]], env: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(commands)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_control_commands_import_neither_torch_nor_ray(tmp_path, monkeypatch):
    root = f"file://{tmp_path}/runs"
    for var in ("ETRAIN_STORE", "ETRAIN_RUN_TOKEN", "ETRAIN_ADMIN_TOKEN", "ETRAIN_SERVICE_STORE", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))  # the run's token, where the commands look for it
    env = {**os.environ, "PYTHONPATH": ROOT}
    _, store = prepare_run("examples/tiny.toml", [f'checkpoint.url="{root}"'], run_id="r1", store=root,
                           owner="alice")
    lease = store.acquire("r1", "ctl-test", ttl_s=120)
    store.put_status("r1", {"run_id": "r1", "phase": "RUNNING", "step": 3, "world_size": 2,
                            "controller_id": "ctl-test"}, lease)
    s = ["--store", root]
    out = probe([["status", "r1", *s], ["status", *s], ["events", "r1", *s], ["queue", *s], ["quota", *s],
                 ["resize", "r1", "--workers", "1", *s], ["suspend", "r1", "--no-wait", *s],
                 ["stop", "r1", "--no-wait", *s]], env)
    assert out["codes"] == [0] * 8, out
    assert out["heavy"] == [], out
    assert probe([["status", "--help"]], env)["heavy"] == []
