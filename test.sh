#!/usr/bin/env bash
# Installs everything into .venv, then runs the test suite (fast tests plus the real
# end-to-end set; `-m slow` cases are left out). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install.sh
# The playground's browser test drives Debian's Chromium, headless; installed once where missing.
if ! { command -v chromium && command -v chromedriver; } >/dev/null; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    packages=(chromium chromium-driver)
    $SUDO apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null 2>&1 \
        || { $SUDO apt-get update -qq >/dev/null 2>&1 && $SUDO apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null; } \
        || echo "test.sh: could not install Chromium; the browser test will be skipped" >&2
fi
exec .venv/bin/python -m pytest -q "${@}"
