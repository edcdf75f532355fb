"""The run store: its interface and backends (storage, etcd), the documents it holds, liveness, and this user's
runs (run id -> store URL)."""
