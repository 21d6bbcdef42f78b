#!/usr/bin/env bash
# The README's test command: set up (first run only) and run the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/env.sh"
cd "$TESSERA_ROOT"
# Every test spawns interpreters (launchers, ranks, data servers) that import the project: compile
# it once here, or each of them compiles it again where PYTHONDONTWRITEBYTECODE is set.
python -m compileall -q -j 0 protos dataservice core moe interop bench tests >/dev/null
# Two test processes where there are two cores: most tests spawn ranks, servers or CLIs that
# spend part of their time waiting on each other, so a second test fills the idle core (the
# suite on 2 cores: 15 min against 18). TESSERA_TEST_WORKERS=1 runs them one at a time.
workers="${TESSERA_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 1 ))}"
parallel=()
if (( workers > 1 )) && python -c 'import xdist' 2>/dev/null; then parallel=(-n "$workers"); fi
# --durations: the slowest tests in every log (CI included), where the time goes.
exec python -m pytest -q --durations=30 ${parallel[@]+"${parallel[@]}"} "$@"
