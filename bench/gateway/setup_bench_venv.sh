#!/bin/sh
# The benchmark-only venv: peer proxies and matplotlib, kept out of the project's .venv.
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
python3 -m venv "$root/.venv-bench"
"$root/.venv-bench/bin/pip" install -q matplotlib 'litellm[proxy]==1.108.7' vllm-router
