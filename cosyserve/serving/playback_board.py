"""What the BLS instances of one Triton server know of each other's streams: when each stream's
listener runs out of audio (the end of its playback so far, :class:`cosyserve.clients.Playback`).

Every BLS instance is a process of its own (a child of tritonserver) serving one request at a time.
Each writes the playback end of the stream it is sending into one small file of its own, in a
directory named after the server's process id on a memory file system, and removes it when the
stream ends; any instance can read them all to learn how far ahead of its listener the least
buffered stream is, or how many streams the server is sending. ``time.monotonic()`` is one clock
for every process of the machine.

A stream is on the board from the moment its instance takes it: before its first chunk its entry
reads :data:`STARTING` (no playback yet, nothing to run short of), so that it is counted by
:meth:`PlaybackBoard.streams` while it waits for its first audio. :class:`Admission` is the rule a
BLS instance applies to a new request from what the board shows (docs/operations.md).
"""

from __future__ import annotations

import math
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

from ..errors import CapacityError

_VALUE = struct.Struct("d")
PREFIX = "cosyserve-playback-"
STARTING = math.inf  # the playback end of a stream taken but with no chunk sent yet
# What a request refused by the stream cap is told to wait: a place frees when one of the running
# streams has sent its last chunk, which the board cannot foresee; with several streams of a few
# seconds' generation each, one ends every few hundred milliseconds on average.
STREAM_CAP_RETRY_AFTER_MS = 500


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
        """This process's stream now plays until ``playback_end`` (monotonic seconds; :data:`STARTING`:
        taken, no chunk sent yet); None: no stream."""
        if playback_end is None:
            self._own.unlink(missing_ok=True)
            return
        staging = self.directory / f".{self.pid}.tmp"
        staging.write_bytes(_VALUE.pack(playback_end))
        os.replace(staging, self._own)  # readers see the old value or the new one, never half of one

    def _others(self) -> list[float]:
        """The playback ends of the streams the other live processes of this server are sending."""
        ends = []
        for entry in self.directory.iterdir():
            if not entry.name.isdigit() or int(entry.name) == self.pid:
                continue
            try:
                data = entry.read_bytes()
            except FileNotFoundError:  # its stream just ended
                continue
            if len(data) == _VALUE.size and _alive(int(entry.name)):
                ends.append(_VALUE.unpack(data)[0])
        return ends

    def least_buffered(self, now: float) -> float | None:
        """Seconds of audio the least buffered stream of the other processes still has at ``now``
        (negative: its playback has stalled; inf: every one is still before its first chunk), or
        None when none of them is streaming."""
        ends = self._others()
        return min(ends) - now if ends else None

    def streams(self) -> int:
        """How many streams the other processes of this server are sending (this one's not counted)."""
        return len(self._others())

    def close(self) -> None:
        self._own.unlink(missing_ok=True)


class Admission:
    """Whether a BLS instance takes a new request: not while the server already sends ``max_streams``
    streams (0: no cap), nor while one of its streams has less than ``min_buffer_s`` of audio
    buffered ahead of its listener (0: off). A refusal is a CapacityError "overloaded: ...".

    Offline requests obey both rules, as they take the same LLM and token2wav time as a stream from
    the streams already running, but are not counted: they have no listener to keep fed, and their
    own instances (OFFLINE_BLS_INSTANCE_NUM) bound them. A stream is put on the board
    (:data:`STARTING`) before the others are counted, and taken off again when refused: of two
    instances taking a stream at the same moment at least one sees the other, so the cap is never
    exceeded (both may be refused when one place was left)."""

    def __init__(self, board: PlaybackBoard, max_streams: int = 0, min_buffer_s: float = 0.0):
        self.board = board
        self.max_streams = max_streams
        self.min_buffer_s = min_buffer_s

    def admit(self, stream: bool) -> None:
        """Take a request (a ``stream``: it is on the board from now on), or raise CapacityError."""
        if stream:
            self.board.publish(STARTING)
        try:
            self._check()
        except CapacityError:
            if stream:
                self.board.publish(None)
            raise

    def _check(self) -> None:
        if self.max_streams > 0:
            streams = self.board.streams()
            if streams >= self.max_streams:
                raise CapacityError(f"overloaded: this server is sending {streams} streams, its limit of "
                                    f"{self.max_streams} (max_streams); retry after {STREAM_CAP_RETRY_AFTER_MS} ms")
        threshold = self.min_buffer_s
        least = self.board.least_buffered(time.monotonic()) if threshold > 0 else None
        if least is not None and least < threshold:
            raise CapacityError(f"overloaded: a stream on this server has {least:.2f} s of audio buffered, under the "
                                f"{threshold:g} s it keeps for every stream (admission_min_buffer_s); retry after "
                                f"{max(100, round(1000 * (threshold - least)))} ms")
