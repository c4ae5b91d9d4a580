"""PlaybackBoard (cosyserve/serving/playback_board.py): BLS processes of one server see each other's
streams' playback ends and count them; ended streams, dead processes and other servers' boards do not
count. Admission: the stream cap (max_streams) and the buffer rule (admission_min_buffer_s)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cosyserve.errors import CapacityError, is_overload
from cosyserve.serving.playback_board import PREFIX, STARTING, Admission, PlaybackBoard


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
    assert mine.streams() == 0


def test_boards_of_servers_that_are_gone_are_removed(tmp_path):
    gone = a_dead_pid()
    (tmp_path / f"{PREFIX}{gone}").mkdir()  # left by a server that was killed
    (tmp_path / f"{PREFIX}{gone}" / "123").write_bytes(b"\0" * 8)
    PlaybackBoard(os.getpid(), root=tmp_path)
    assert not (tmp_path / f"{PREFIX}{gone}").exists()
    assert (tmp_path / f"{PREFIX}{os.getpid()}").exists()


def test_the_streams_of_the_other_live_processes_are_counted(tmp_path):
    server = os.getpid()
    mine = PlaybackBoard(server, pid=os.getpid(), root=tmp_path)
    other = PlaybackBoard(server, pid=os.getppid(), root=tmp_path)
    assert mine.streams() == other.streams() == 0
    other.publish(STARTING)  # taken, no chunk sent yet: counted, and nothing to run short of
    assert mine.streams() == 1 and mine.least_buffered(now=10.0) == float("inf")
    mine.publish(11.0)
    assert mine.streams() == 1 and other.streams() == 1  # its own stream does not count for itself
    assert other.least_buffered(now=10.0) == 1.0
    other.publish(12.5)
    assert mine.streams() == 1
    PlaybackBoard(server, pid=a_dead_pid(), root=tmp_path).publish(10.5)  # died mid-stream
    PlaybackBoard(os.getppid(), pid=os.getppid(), root=tmp_path).publish(10.1)  # another server's
    assert mine.streams() == 1
    other.publish(None)
    assert mine.streams() == 0 and other.streams() == 1


@pytest.fixture
def instances(tmp_path):
    """``instances(count, **rules)``: ``count`` BLS instances of one server, each an Admission over
    the board as its process sees it (sleeping child processes stand for the instances' live pids)."""
    sleepers = []

    def make(count: int, **rules) -> list[Admission]:
        sleepers.extend(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(count))
        return [Admission(PlaybackBoard(os.getpid(), pid=p.pid, root=tmp_path), **rules) for p in sleepers[-count:]]

    yield make
    for process in sleepers:
        process.kill()
        process.wait()


def test_a_stream_past_max_streams_is_refused_and_takes_no_place(instances):
    a, b, c = instances(3, max_streams=2)
    a.admit(stream=True)
    b.admit(stream=True)  # on the board before its first chunk
    with pytest.raises(CapacityError) as refusal:
        c.admit(stream=True)
    message = str(refusal.value)
    assert message == "overloaded: this server is sending 2 streams, its limit of 2 (max_streams); retry after 500 ms"
    assert is_overload(message)
    assert a.board.streams() == 1 and b.board.streams() == 1  # the refused stream left the board
    b.board.publish(None)  # b's stream ended
    c.admit(stream=True)
    assert a.board.streams() == 1 and c.board.streams() == 1


def test_offline_requests_obey_the_cap_but_are_not_counted(instances):
    streaming, offline, newcomer = instances(3, max_streams=1)
    offline.admit(stream=False)  # nothing streams: taken, and not on the board
    assert streaming.board.streams() == 0
    streaming.admit(stream=True)  # the offline request in flight does not count
    with pytest.raises(CapacityError, match=r"^overloaded: .*\(max_streams\)"):
        offline.admit(stream=False)
    with pytest.raises(CapacityError, match="max_streams"):
        newcomer.admit(stream=True)


def test_two_streams_taken_at_the_same_moment_never_both_pass_the_cap(instances):
    """Each instance publishes before it counts, and withdraws when refused: of two instances taking
    the last place at once, at least one sees the other."""
    a, b = instances(2, max_streams=1)
    outcomes = {}

    def attempt(name: str, admission: Admission) -> None:
        try:
            admission.admit(stream=True)
            outcomes[name] = "admitted"
        except CapacityError:
            outcomes[name] = "refused"

    count = a.board.streams

    def b_arrives_meanwhile() -> int:
        attempt("b", b)
        return count()

    a.board.streams = b_arrives_meanwhile  # b's whole admission between a's publish and a's count
    attempt("a", a)
    a.board.streams = count
    assert outcomes == {"a": "admitted", "b": "refused"}  # b saw a; a counted after b had left
    a.board.publish(None)
    # both publish before either counts: each sees the other, both are refused (and retry)
    a.board.publish(STARTING)
    b.board.publish(STARTING)
    assert a.board.streams() >= a.max_streams and b.board.streams() >= b.max_streams


def test_the_buffer_rule_and_no_rules(instances):
    running, careful, open_door = instances(3, max_streams=0, min_buffer_s=0.5)
    open_door.min_buffer_s = 0  # no rule: admits whatever runs
    running.board.publish(time.monotonic() + 0.2)  # 0.2 s of audio buffered
    with pytest.raises(CapacityError, match="admission_min_buffer_s"):
        careful.admit(stream=True)
    assert running.board.streams() == 0  # the refused stream left the board
    open_door.admit(stream=True)
    open_door.admit(stream=False)
    running.board.publish(time.monotonic() + 5)
    careful.admit(stream=True)  # enough audio buffered everywhere
    running.board.publish(STARTING)
    careful.admit(stream=False)  # a stream before its first chunk has nothing to run short of
