#!/usr/bin/env bash
# Install what mfotel needs into ./.venv (idempotent). Usage: scripts/bootstrap.sh [demo|test]
#   demo: the package with MindSpore (CPU)
#   test: everything: mindformers, dev tools, and Debian's prometheus + alertmanager binaries,
#         chromium (the live page's browser tests) and victoria-metrics (the remote_write store)
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-test}"
python="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi

extras="mindspore"
[ "$mode" = "test" ] && extras="mindspore,mindformers,dev,plot,otlp"
stamp=".venv/.mfotel-$mode-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    # uv installs from its cache by linking, not unpacking: a fresh .venv in ~35 s here
    # instead of pip's ~90 s (MindSpore and its dependencies are ~2 GB unpacked). Compiled to
    # bytecode as pip does: without it, where PYTHONDONTWRITEBYTECODE is set, every process
    # compiles MindSpore again (importing it took 6.4 CPU-s instead of 2.8; the suite 17 min
    # instead of 13). Except for `make test`, which runs its processes without
    # PYTHONDONTWRITEBYTECODE, so that each module is compiled once, when first imported:
    # compiling all of site-packages took 45 CPU-s, mostly for modules no test imports.
    # Where uv cannot be had (an index without it), pip does the same install (compiled).
    if [ ! -x .venv/bin/uv ] && ! .venv/bin/pip install --quiet uv; then
        echo "bootstrap: uv not available; installing with pip (slower)" >&2
        .venv/bin/pip install --quiet --upgrade pip
    fi
    echo "bootstrap: installing mfotel[$extras] into .venv (MindSpore is ~800 MB; uv and pip cache it)"
    if [ -x .venv/bin/uv ]; then
        compile=--compile-bytecode
        [ "$mode" = "test" ] && compile=--no-compile-bytecode
        .venv/bin/uv pip install --quiet "$compile" --python .venv/bin/python -e ".[$extras]"
    else
        .venv/bin/pip install --quiet -e ".[$extras]"
    fi
    touch "$stamp"
fi

if [ "$mode" = "test" ]; then
    missing=()
    command -v promtool >/dev/null || missing+=(prometheus)
    { command -v prometheus-alertmanager || command -v alertmanager; } >/dev/null || missing+=(prometheus-alertmanager)
    # the live page's browser tests: Playwright drives this binary (it never downloads one)
    [ -x /usr/bin/chromium ] || missing+=(chromium)
    # the long-term store of examples/prometheus/victoriametrics.yml (remote_write), queried
    # by the dashboards test through its Prometheus-compatible API
    command -v victoria-metrics >/dev/null || missing+=(victoria-metrics)
    if [ ${#missing[@]} -gt 0 ]; then
        echo "bootstrap: installing Debian packages: ${missing[*]}"
        sudo=""
        [ "$(id -u)" -ne 0 ] && sudo="sudo"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    # The Debian packages may start system services on the default ports (9090, 9093, 9100,
    # 8428).
    # They are left alone: the tests start their own servers on free loopback ports, with
    # their own data directories and Alertmanager clustering off.
fi
