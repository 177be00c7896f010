#!/usr/bin/env bash
# Installs everything into .venv, then serves the stack on the default models and streams one
# demo answer. Arguments go to `specdec serve` (e.g. --port 50052, --config my.yaml).
set -euo pipefail
cd "$(dirname "$0")"
scripts/install.sh
exec .venv/bin/specdec serve --demo "${@}"
