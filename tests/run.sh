#!/usr/bin/env bash
# The README's test command: set up (first run only) and run the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/env.sh"
cd "$TESSERA_ROOT"
# Every test spawns interpreters (launchers, ranks, data servers) that import the project: compile
# it once here, or each of them compiles it again where PYTHONDONTWRITEBYTECODE is set.
python -m compileall -q -j 0 protos dataservice core moe interop bench tests >/dev/null
# --durations: the slowest tests in every log (CI included), where the time goes.
exec python -m pytest -q --durations=30 "$@"
