#!/usr/bin/env bash
# The system packages the tests need, on Debian or Ubuntu: installed only when their commands are missing.
#
#   deploy/install-sysdeps.sh      # what `make sysdeps` runs; `make test`, `test-ray` and `soak` run it first
#
#   etcd        etcd-server    the etcd run store's tests (a real server on 127.0.0.1)
#   prometheus  prometheus     the metrics tests scrape through a real Prometheus
#   ip          iproute2       `ip netns` for the network-partition chaos test
#   tmux        tmux
#   python3 -m venv            python3-venv (Debian leaves ensurepip out of python3), until .venv exists
#
# As root it runs apt-get for what is missing; otherwise it prints the exact command and exits 1.
# PYTHON and VENV are the Makefile's (python3, .venv).
set -euo pipefail

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

missing=()
for pair in etcd:etcd-server prometheus:prometheus ip:iproute2 tmux:tmux; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
if [ ! -x "$VENV/bin/python" ] && ! "$PYTHON" -c "import ensurepip, venv" >/dev/null 2>&1; then
    missing+=(python3-venv)
fi
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi

install="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y ${missing[*]}"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install-sysdeps: installing ${missing[*]}" >&2
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
    exit 0
fi
echo "install-sysdeps: the tests need the system packages ${missing[*]}; install them as root:" >&2
echo "    sudo sh -c '$install'" >&2
exit 1
