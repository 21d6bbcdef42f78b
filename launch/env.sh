#!/usr/bin/env bash
# Sourced by the README's commands: make sure ./.venv exists with Tessera and its
# dependencies installed, then put it first on PATH. Idempotent and quick when up to date.
set -euo pipefail
TESSERA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Machines without a package index (GPU hosts with their own torch) use the Python on PATH as it
# is, with the tessera-* commands on PATH already: TESSERA_NO_VENV=1.
if [ -n "${TESSERA_NO_VENV:-}" ]; then return 0 2>/dev/null || exit 0; fi
VENV="${TESSERA_VENV:-$TESSERA_ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
stamp="$VENV/.tessera-installed"
want="$(sha1sum "$TESSERA_ROOT/pyproject.toml" | cut -c1-40)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[tessera] setting up $VENV (first run only)" >&2
  "$PYTHON" -m venv "$VENV"
  # A machine with CUDA torch already installed keeps it; otherwise the CPU wheel.
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    "$VENV/bin/pip" install -q "torch==2.13.0" 2>&1 | grep -v '^WARNING: Location' || true
  fi
  "$VENV/bin/pip" install -q -e "$TESSERA_ROOT[dev]" 2>&1 | grep -v '^WARNING: Location' || true
  "$VENV/bin/python" -c 'import torch, grpc, lmdb, xxhash, protos; protos.load()'
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
