"""Processes of a running server, read from /proc: whether a pid runs, and its Python stubs.

Shared by the launcher (:mod:`.tritonserver`) and the stub watcher (:mod:`.stub_watch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STUB_EXECUTABLE = "triton_python_backend_stub"


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]  # the command name may contain spaces
    return state not in ("Z", "X")


@dataclass(frozen=True)
class Stub:
    """A stub process: ``model`` (the name of its model's folder) and ``instance`` (e.g. ``llm_0_0``)."""

    pid: int
    model: str
    instance: str


def python_stubs(server_pid: int) -> dict[int, Stub]:
    """The running stub processes whose parent is ``server_pid``, by pid.

    A stub's argv: the stub, ``<repo>/<model>/<version>/model.py``, the shared-memory region and
    sizes, the parent's pid, the backend folder, an IPC handle, the instance name, its kind."""
    stubs = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # a process that just ended
            continue
        if len(argv) < 9 or not argv[0].endswith(STUB_EXECUTABLE.encode()) or argv[5] != str(server_pid).encode():
            continue
        pid = int(entry.name)
        if is_running(pid):  # not a zombie the server has yet to reap
            stubs[pid] = Stub(pid, Path(argv[1].decode()).parts[-3], argv[8].decode())
    return stubs
