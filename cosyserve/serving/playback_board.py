"""What the BLS instances of one Triton server know of each other's streams: when each stream's
listener runs out of audio (the end of its playback so far, :class:`cosyserve.clients.Playback`).

Every BLS instance is a process of its own (a child of tritonserver) serving one request at a time.
Each writes the playback end of the stream it is sending into one small file of its own, in a
directory named after the server's process id on a memory file system, and removes it when the
stream ends; any instance can read them all to learn how far ahead of its listener the least
buffered stream is. ``time.monotonic()`` is one clock for every process of the machine.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path

_VALUE = struct.Struct("d")
PREFIX = "cosyserve-playback-"


def board_root() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PlaybackBoard:
    """The board of the server process ``server_pid`` (default: this process's parent, tritonserver),
    as seen from process ``pid`` (default: this one)."""

    def __init__(self, server_pid: int | None = None, pid: int | None = None, root: Path | None = None):
        self.pid = pid or os.getpid()
        root = root or board_root()
        self.directory = root / f"{PREFIX}{server_pid or os.getppid()}"
        self.directory.mkdir(exist_ok=True)
        self._own = self.directory / str(self.pid)
        for stale in root.glob(f"{PREFIX}*"):  # boards of servers that are gone
            owner = stale.name[len(PREFIX):]
            if owner.isdigit() and not _alive(int(owner)):
                shutil.rmtree(stale, ignore_errors=True)

    def publish(self, playback_end: float | None) -> None:
        """This process's stream now plays until ``playback_end`` (monotonic seconds); None: no stream."""
        if playback_end is None:
            self._own.unlink(missing_ok=True)
            return
        staging = self.directory / f".{self.pid}.tmp"
        staging.write_bytes(_VALUE.pack(playback_end))
        os.replace(staging, self._own)  # readers see the old value or the new one, never half of one

    def least_buffered(self, now: float) -> float | None:
        """Seconds of audio the least buffered stream of the other processes still has at ``now``
        (negative: its playback has stalled), or None when none of them is streaming."""
        least = None
        for entry in self.directory.iterdir():
            if not entry.name.isdigit() or int(entry.name) == self.pid:
                continue
            try:
                data = entry.read_bytes()
            except FileNotFoundError:  # its stream just ended
                continue
            if len(data) != _VALUE.size or not _alive(int(entry.name)):
                continue
            buffered = _VALUE.unpack(data)[0] - now
            least = buffered if least is None else min(least, buffered)
        return least

    def close(self) -> None:
        self._own.unlink(missing_ok=True)
