#!/usr/bin/env bash
# The README's test command: set up (first run only) and run the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/env.sh"
cd "$TESSERA_ROOT"
exec python -m pytest -q "$@"
