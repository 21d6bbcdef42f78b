#!/usr/bin/env bash
# The README's test command: set up (first run only) and run the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/env.sh"
cd "$TESSERA_ROOT"
# --durations: the slowest tests in every log (CI included), where the time goes.
exec python -m pytest -q --durations=30 "$@"
