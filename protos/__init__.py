"""The data service's wire contract.

`dataservice.proto` is the source; the `*_pb2*.py` modules are build outputs, generated
here on first import (and again when the .proto is newer) with grpcio-tools, so that no
generated code is ever committed or hand-edited.
"""

from __future__ import annotations

import importlib
import threading
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_PROTO = _HERE / "dataservice.proto"
_OUTPUTS = (_HERE / "dataservice_pb2.py", _HERE / "dataservice_pb2_grpc.py")
_lock = threading.Lock()


def _stale() -> bool:
    mtime = _PROTO.stat().st_mtime
    return any(not out.exists() or out.stat().st_mtime < mtime for out in _OUTPUTS)


def generate() -> None:
    """Compile dataservice.proto into Python modules next to it."""
    from grpc_tools import protoc

    import grpc_tools

    include = str(Path(grpc_tools.__file__).resolve().parent / "_proto")
    root = _HERE.parent
    args = [
        "protoc",
        f"-I{root}",
        f"-I{include}",
        f"--python_out={root}",
        f"--grpc_python_out={root}",
        str(_PROTO.relative_to(root)),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code} on {_PROTO}")


def load():
    """Return (pb2, pb2_grpc), generating them if needed."""
    with _lock:
        if _stale():
            # Several processes (trainer ranks, test workers) may start together: serialise.
            import fcntl

            with open(_HERE / ".generate.lock", "w") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX)
                if _stale():
                    generate()
            importlib.invalidate_caches()
    pb2 = importlib.import_module("protos.dataservice_pb2")
    pb2_grpc = importlib.import_module("protos.dataservice_pb2_grpc")
    return pb2, pb2_grpc

