"""No secret in a URL ever reaches the output: every command that prints, logs or raises about a URL
the user gave (run stores, checkpoint and data URLs, checkpoints to list or sample, the Ray cluster and
its dashboard, the run registry) is driven with URLs carrying user:password@ and a query token, and its
stdout, stderr and log records must hold neither. Each site shows the URL as ``checkpointing.names.redact``
does. (``logging.mlflow_uri`` and the ``ckpt export`` target have tests of their own.)
"""

from __future__ import annotations

import logging

import pytest

from checkpointing.names import redact, validate_run_id

PASSWORD, TOKEN = "Pw0rdS3cret", "QT0kenS3cret"
URLS = {
    "userinfo": f"s3://AKIDUSER:{PASSWORD}@bucket/runs/r",
    "query": f"file:///nonexistent/runs/r?token={TOKEN}",
    "both": f"s3://AKIDUSER:{PASSWORD}@bucket/runs?X-Amz-Signature={TOKEN}",
    "etcd": f"etcd://user:{PASSWORD}@127.0.0.1:1/etrain?token={TOKEN}",
    "http": f"http://user:{PASSWORD}@127.0.0.1:1/x?token={TOKEN}",
}
TINY = ["examples/tiny.toml", "--set", "train.steps=1", "--set", "data.max_bytes=100000"]

# Every site, as the argv of `etrain` with U for the URL.
SITES = {
    "status --store": ["status", "--store", "U"],
    "status RUN --store": ["status", "r", "--store", "U"],
    "events --store": ["events", "r", "--store", "U"],
    "stop --store": ["stop", "r", "--store", "U"],
    "suspend --store": ["suspend", "r", "--store", "U"],
    "resize --store": ["resize", "r", "--workers", "2", "--store", "U"],
    "resume --store": ["resume", "r", "--store", "U"],
    "top --store": ["top", "r", "--once", "--store", "U"],
    "plot --store": ["plot", "r", "--store", "U", "-o", "/nonexistent/x.png"],
    "chaos --store": ["chaos", "r", "--plan", "examples/tiny.toml", "--store", "U"],
    "run --store": ["run", *TINY, "--store", "U", "--no-progress"],
    "checkpoint.url": ["train", *TINY, "--set", 'checkpoint.url="U"'],
    "data.source": ["train", *TINY, "--set", 'data.source="U"'],
    "eval.source": ["train", *TINY, "--set", 'eval.source="U"'],
    "model.init_from": ["train", *TINY, "--set", 'model.init_from="U"'],
    "data.tokenizer": ["train", *TINY, "--set", 'data.tokenizer="U"'],
    "model.hf_config": ["train", *TINY, "--set", 'model.source="hf"', "--set", 'model.hf_config="U"'],
    "ckpt ls": ["ckpt", "ls", "U"],
    "ckpt ls --run": ["ckpt", "ls", "U", "--run", "r"],
    "ckpt inspect": ["ckpt", "inspect", "U"],
    "ckpt verify": ["ckpt", "verify", "U"],
    "generate": ["generate", "U", "--prompt", "a"],
}


def drive(argv: list[str], capsys, caplog) -> tuple[int | str, str]:
    from orchestrator.cli.main import main

    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    out = capsys.readouterr()
    return rc, out.out + out.err + "\n".join(r.getMessage() for r in caplog.records)


def assert_secret_free(rc, text: str, argv: list[str]) -> None:
    assert PASSWORD not in text and TOKEN not in text, f"etrain {' '.join(argv)} printed a secret:\n{text}"
    assert rc in (1, 2) and "Traceback" not in text, (rc, text)


@pytest.mark.parametrize("kind", URLS)
@pytest.mark.parametrize("site", SITES)
def test_no_command_prints_the_secret_of_a_url(site, kind, capsys, caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))
    argv = [a.replace("U", URLS[kind]) if a == "U" or '"U"' in a else a for a in SITES[site]]
    rc, text = drive(argv, capsys, caplog)
    assert_secret_free(rc, text, argv)


@pytest.mark.parametrize("argv", [["status"], ["status", "r"], ["events", "r"]])
def test_the_store_of_a_run_registry_entry_or_env_is_never_printed_whole(argv, capsys, caplog, tmp_path,
                                                                        monkeypatch):
    from orchestrator.store import user_runs as registry

    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    registry.record("r", URLS["both"])
    rc, text = drive(argv, capsys, caplog)
    assert PASSWORD not in text and TOKEN not in text, text
    monkeypatch.setenv("ETRAIN_STORE", URLS["etcd"])
    rc, text = drive(argv, capsys, caplog)
    assert_secret_free(rc, text, argv)


@pytest.mark.parametrize("kind", ["both", "http"])
@pytest.mark.parametrize("argv", [["submit", *TINY, "--address", "U", "--store", "STORE"],
                                  ["resume", "r", "--submit", "U", "--store", "STORE"],
                                  ["run", *TINY, "--address", "U", "--store", "STORE", "--no-progress"]])
def test_the_ray_cluster_address_is_never_printed_whole(argv, kind, capsys, caplog, tmp_path, monkeypatch):
    """Ray's own errors (an unreachable dashboard, an address it cannot parse) repeat the address."""
    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))
    argv = [URLS[kind] if a == "U" else f"file://{tmp_path}/runs" if a == "STORE" else a for a in argv]
    if argv[0] == "resume":  # a run to resume, so that the command gets as far as the cluster
        from orchestrator.store.run_store import RunSpec, open_store

        open_store(f"file://{tmp_path}/runs").create_run(RunSpec("r", {"run_id": "r"}, 1, 1, 1))
    rc, text = drive(argv, capsys, caplog)
    assert_secret_free(rc, text, argv)
    assert redact(URLS[kind]) in text  # where it went, as every message shows it


def test_a_run_id_cut_from_a_url_is_shown_without_its_secrets():
    for bad in (f"r?token={TOKEN}", f"AKID:{PASSWORD}@bucket", f"u:{PASSWORD}@h:1?sig={TOKEN}"):
        with pytest.raises(ValueError) as e:
            validate_run_id(bad)
        assert PASSWORD not in str(e.value) and TOKEN not in str(e.value), str(e.value)


def test_redact_text_replaces_the_url_and_its_parts_in_a_librarys_message():
    from checkpointing.names import redact_text

    url = URLS["http"]
    msg = f"Failed to connect to {url}. Invalid bucket name \"user:{PASSWORD}@bucket\" (query token={TOKEN})"
    shown = redact_text(msg, url)
    assert PASSWORD not in shown and TOKEN not in shown and redact(url) in shown and "bucket name" in shown
