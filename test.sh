#!/usr/bin/env bash
# Installs everything into .venv, then runs the test suite (fast tests plus the real
# end-to-end set; `-m slow` cases are left out). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install.sh
exec .venv/bin/python -m pytest -q "${@}"
