"""Watch a tritonserver's Python stub processes; when one dies under a loaded model, end the server.

Each instance of a Python model runs in its own stub process (``triton_python_backend_stub``).
When one dies (killed, out of memory, a crash in native code), Triton 24.10's Python backend does
not start a new one and its health endpoints go on reporting the server and the model ready, while
every request that reaches the dead instance fails; worse, a BLS reading the response stream of a
dead ``llm`` stub waits for ever, because Triton does not deliver a decoupled model's error to a BLS
caller. Reloading the model (explicit model control) does not free such a BLS.

So this watcher, a process of its own started next to the server (``start_server(...,
watch_stubs=True)``, run.sh's ``EXIT_ON_STUB_CRASH=true``), checks every ``interval_s`` seconds that
every stub it has seen is still alive. A stub that is gone while no other stub serves its instance
and Triton still lists its model as READY (so not an unload or a reload through the repository API,
nor a shutdown) has crashed: the watcher writes one line saying which to the server log and kills
the server's process group (SIGKILL). Every in-flight request then fails at once (the connection
closes), the health endpoints stop answering, and the server's exit status is non-zero (killed by
signal 9), so a supervisor (compose ``restart:``, Kubernetes, the container's own loop) starts it
again. The watcher ends with the server.

    python -m cosyserve.serving.stub_watch --server-pid PID --http-port 8000 [--interval-s 1] \\
        [--stub PID MODEL INSTANCE ...]

``--stub``: stubs the launcher saw when the server became ready, so that one that dies before the
watcher's first look is still known (on a loaded machine the watcher may start seconds late).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import Sequence

from .processes import Stub, is_running, python_stubs

DEFAULT_INTERVAL_S = 1.0


def ready_models(http_port: int) -> set[str] | None:
    """The models Triton lists as READY (its repository index), or None when it does not answer."""
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/repository/index", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            index = json.load(reply)
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return {model["name"] for model in index if model.get("state") == "READY"}


def crashed_stubs(seen: dict[int, Stub], alive: dict[int, Stub], ready: set[str]) -> list[Stub]:
    """Stubs of ``seen`` that are not ``alive``, whose instance no live stub serves (a reload starts
    the new stubs first) and whose model is ``ready`` (an unload or a shutdown unloads it first)."""
    serving = {stub.instance for stub in alive.values()}
    return [stub for pid, stub in seen.items()
            if pid not in alive and stub.instance not in serving and stub.model in ready]


def watch(server_pid: int, http_port: int, interval_s: float = DEFAULT_INTERVAL_S,
          known: Sequence[Stub] = ()) -> Stub | None:
    """Until the server exits (None) or one of its stubs (``known`` ones or any seen since) crashes:
    then the server's process group is killed and the stub returned."""
    seen = {stub.pid: stub for stub in known}
    while is_running(server_pid):
        alive = python_stubs(server_pid)
        gone = {pid: stub for pid, stub in seen.items() if pid not in alive}
        if gone:
            ready = ready_models(http_port)
            crashed = crashed_stubs(gone, alive, ready) if ready is not None else []
            if crashed:
                stub = crashed[0]
                print(f"cosyserve stub watch: the Python stub of model instance {stub.instance!r} (pid {stub.pid}) "
                      f"died while model {stub.model!r} was loaded; Triton does not replace it and would go on "
                      f"reporting ready, so tritonserver (pid {server_pid}) is killed (SIGKILL, exit status "
                      f"non-zero) for its supervisor to restart it", flush=True)
                os.killpg(server_pid, signal.SIGKILL)  # started in a session of its own: the group holds the stubs
                return stub
            if ready is None:  # the server does not answer (busy or stopping): decide at the next look
                alive = {**alive, **gone}
        seen = alive
        time.sleep(interval_s)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyserve.serving.stub_watch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--interval-s", type=float, default=DEFAULT_INTERVAL_S)
    parser.add_argument("--stub", nargs=3, action="append", default=[], metavar=("PID", "MODEL", "INSTANCE"),
                        help="a stub process already running (repeat for each)")
    args = parser.parse_args(argv)
    known = [Stub(int(pid), model, instance) for pid, model, instance in args.stub]
    watch(args.server_pid, args.http_port, args.interval_s, known)
    return 0


if __name__ == "__main__":
    sys.exit(main())
