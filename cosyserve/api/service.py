"""Start the API in the background, as run.sh stage 3 does:

    python -m cosyserve.api.service start --pid-file F --log L -- <python -m cosyserve.api arguments>

``start`` returns once ``/health`` answers 200 (Triton ready behind it), or fails with the log's
tail. ``bash run.sh stop`` stops it from the pid file with bash alone (scripts/lib.sh), since
importing this module imports the whole pipeline.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from ..serving.tritonserver import TritonServerError, is_running, read_pid_file, stop_process, write_pid_file
from .server import parser as api_parser


class APIServiceError(RuntimeError):
    pass


def _is_api(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return False
    return b"cosyserve.api" in argv


def start(api_args: Sequence[str], pid_file: Path, log: Path, timeout: float) -> int:
    running = read_pid_file(pid_file)
    if running is not None and is_running(running) and _is_api(running):
        raise APIServiceError(f"the API from {pid_file} is already running (pid {running}); stop it first")
    args = api_parser().parse_args(list(api_args))
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "cosyserve.api", *api_args], stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    write_pid_file(pid_file, process.pid)
    url = f"http://127.0.0.1:{args.port}/health"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return process.pid
        except (urllib.error.URLError, OSError):
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                stop_process(process.pid)
            Path(pid_file).unlink(missing_ok=True)
            tail = log.read_text(errors="replace")[-3000:]
            raise APIServiceError(f"the API did not become ready at {url} (exit code {process.poll()}); "
                                  f"log {log}:\n{tail}")
        time.sleep(0.3)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyserve.api.service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    start_parser = commands.add_parser("start")
    start_parser.add_argument("--pid-file", required=True, type=Path)
    start_parser.add_argument("--log", required=True, type=Path)
    start_parser.add_argument("--timeout", type=float, default=120.0)
    start_parser.add_argument("api_args", nargs=argparse.REMAINDER, help="after --: python -m cosyserve.api arguments")
    args = parser.parse_args(argv)
    try:
        api_args = args.api_args[1:] if args.api_args[:1] == ["--"] else args.api_args
        pid = start(api_args, args.pid_file, args.log, args.timeout)
        print(f"API ready (pid {pid}); log {args.log}")
    except (APIServiceError, TritonServerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
