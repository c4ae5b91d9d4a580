"""PlaybackBoard (cosyserve/serving/playback_board.py): BLS processes of one server see each other's
streams' playback ends; ended streams, dead processes and other servers' boards do not count."""

from __future__ import annotations

import os
import subprocess
import sys

from cosyserve.serving.playback_board import PREFIX, PlaybackBoard


def a_dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_instances_of_one_server_see_each_others_streams(tmp_path):
    server = os.getpid()  # any live process stands for tritonserver
    mine = PlaybackBoard(server, pid=os.getpid(), root=tmp_path)
    other = PlaybackBoard(server, pid=os.getppid(), root=tmp_path)  # a live pid of another process
    assert mine.least_buffered(now=10.0) is None  # nobody streams
    other.publish(12.5)
    assert mine.least_buffered(now=10.0) == 2.5
    assert mine.least_buffered(now=13.0) == -0.5  # that listener's playback has stalled
    mine.publish(11.0)
    assert mine.least_buffered(now=10.0) == 2.5  # its own stream does not count for itself
    assert other.least_buffered(now=10.0) == 1.0
    other.publish(None)  # the stream ended
    assert mine.least_buffered(now=10.0) is None
    mine.close()
    assert other.least_buffered(now=10.0) is None


def test_a_dead_instance_and_another_servers_streams_do_not_count(tmp_path):
    server = os.getpid()
    mine = PlaybackBoard(server, pid=os.getpid(), root=tmp_path)
    PlaybackBoard(server, pid=a_dead_pid(), root=tmp_path).publish(10.5)  # its process died mid-stream
    PlaybackBoard(os.getppid(), pid=os.getppid(), root=tmp_path).publish(10.1)  # another server
    assert mine.least_buffered(now=10.0) is None


def test_boards_of_servers_that_are_gone_are_removed(tmp_path):
    gone = a_dead_pid()
    (tmp_path / f"{PREFIX}{gone}").mkdir()  # left by a server that was killed
    (tmp_path / f"{PREFIX}{gone}" / "123").write_bytes(b"\0" * 8)
    PlaybackBoard(os.getpid(), root=tmp_path)
    assert not (tmp_path / f"{PREFIX}{gone}").exists()
    assert (tmp_path / f"{PREFIX}{os.getpid()}").exists()
