"""Find, start, wait for and stop a ``tritonserver`` process.

Two installations are supported:

* NVIDIA's container (or any install with ``tritonserver`` on ``PATH``): the binary is used
  as is, with its own backend directory.
* The server bundled in the ``nvidia-pytriton`` wheel. It ships the binary, the Python
  backend library and one Python-backend stub per Python version, but no backend directory
  that Triton can use directly: the Python backend looks for ``triton_python_backend_stub``
  next to ``libtriton_python.so``. We therefore assemble a backend directory of symlinks
  (library, utils module, the stub matching the running interpreter) in a cache directory
  and pass ``--backend-directory``. Because the library is then loaded through a symlink,
  its ``$ORIGIN``-relative RPATH no longer finds the wheel's shared libraries, so
  ``nvidia_pytriton.libs`` goes on ``LD_LIBRARY_PATH``, together with the running
  interpreter's ``libpython`` directory (otherwise the stub may pick up a system libpython
  of another patch release).

In both cases the stub embeds the Python found first on ``PATH``: putting the running
interpreter's ``bin`` directory first makes Triton's Python models see this virtualenv's
packages. The stub's interpreter is isolated (it ignores ``PYTHONPATH`` and the user site),
so ``cosyserve`` and everything the models import must be installed in that environment
(``pip install -e .`` does it; a ``.pth`` file in its site-packages works too). The bundled
stubs (Triton 24.10) read numpy 2 arrays wrongly and die at the first request carrying a
string tensor ("Stub process ... is not healthy"), hence nvidia-pytriton's ``numpy<2``
requirement, which the launcher checks instead of letting the first request fail.

Command line (``run.sh`` stage 3)::

    python -m cosyserve.serving.tritonserver start --model-repo DIR --http-port 8000 \\
        --grpc-port 8001 --metrics-port 8002 --log FILE --pid-file FILE [--timeout 300] \\
        [--watch-stubs] [-- extra tritonserver arguments]
    python -m cosyserve.serving.tritonserver stop --pid-file FILE

``start`` returns once ``/v2/health/ready`` answers 200 and leaves the server running in its
own session (with ``--watch-stubs``, also :mod:`cosyserve.serving.stub_watch`, which kills the
server when one of its Python stub processes dies); ``stop`` sends SIGTERM, then SIGKILL to its
process group after a grace period.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from .processes import is_running, python_stubs


LOG_TAIL_LINES = 40
READY_POLL_S = 0.5
# Triton waits up to 30 s (--exit-timeout-secs) for in-flight requests on SIGTERM.
DEFAULT_STOP_TIMEOUT_S = 45.0

_PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
_STUB_NAME = "triton_python_backend_stub"


class TritonServerError(RuntimeError):
    """tritonserver could not be found, started, made ready or stopped."""


@dataclass(frozen=True)
class TritonInstallation:
    """Where the server binary is and what it needs around it.

    ``backend_directory``/``cache_directory`` are None when the binary's own defaults apply
    (NVIDIA's container); ``library_dirs`` go first on ``LD_LIBRARY_PATH``.
    """

    binary: Path
    backend_directory: Path | None = None
    cache_directory: Path | None = None
    library_dirs: tuple[Path, ...] = ()


def find_tritonserver() -> TritonInstallation:
    """The ``tritonserver`` on PATH if there is one, else the one bundled with nvidia-pytriton."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstallation(binary=Path(on_path))
    return bundled_installation()


def bundled_installation() -> TritonInstallation:
    """The nvidia-pytriton server, with a backend directory whose stub fits this Python."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonServerError(
            "no tritonserver found: it is neither on PATH (NVIDIA's Triton container) nor "
            "bundled with the nvidia-pytriton package (pip install nvidia-pytriton)"
        )
    package_dir = Path(list(spec.submodule_search_locations)[0])
    dist = package_dir / "tritonserver"
    binary = dist / "bin" / "tritonserver"
    if not binary.is_file():
        raise TritonServerError(f"nvidia-pytriton is installed but has no server binary at {binary}")
    # Wheel installs keep the bundled shared libraries next to the package; editable ones inside it.
    wheel_libs = package_dir.parent / "nvidia_pytriton.libs"
    libs = wheel_libs if wheel_libs.is_dir() else dist / "external_libs"
    check_numpy_for_bundled_stub()
    return TritonInstallation(
        binary=binary,
        backend_directory=_python_backend_directory(dist),
        cache_directory=dist / "caches",
        library_dirs=(libs, *_libpython_dirs()),
    )


def check_numpy_for_bundled_stub() -> None:
    """Fail fast where the bundled stub would crash at the first request (see the module docstring)."""
    spec = importlib.util.find_spec("numpy")
    if spec is None:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        numpy_version = version("numpy")
    except PackageNotFoundError:
        return
    if int(numpy_version.split(".")[0]) >= 2:
        raise TritonServerError(
            f"numpy {numpy_version} is installed for {sys.executable}, but the Python backend bundled with "
            "nvidia-pytriton (Triton 24.10) needs numpy<2: its stub misreads numpy 2 arrays and dies at the "
            "first request. Install numpy<2 in this environment (pip install 'numpy<2'), or use NVIDIA's "
            "Triton container"
        )


def _libpython_dirs() -> tuple[Path, ...]:
    """The directory of the running interpreter's shared libpython, if it has one."""
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).is_file():
        return (Path(libdir),)
    return ()


def _python_backend_directory(dist: Path) -> Path:
    """A backend directory (``<dir>/python/...``) of symlinks into ``dist``, built once.

    Built in a temporary directory and renamed into place so that concurrent launches never
    see a half-made one. Keyed by the pytriton location and Python version.
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / _STUB_NAME
    if not stub.is_file():
        available = sorted(p.name for p in (dist / "python_backend_stubs").glob("*"))
        raise TritonServerError(
            f"nvidia-pytriton has no Python backend stub for Python {version} "
            f"(available: {', '.join(available) or 'none'}); run the launcher with one of those"
        )
    targets = {name: dist / "backends" / "python" / name for name in _PYTHON_BACKEND_FILES}
    targets[_STUB_NAME] = stub
    key = hashlib.sha256(str(dist.resolve()).encode()).hexdigest()[:12]
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    backends = cache_root / "cosyserve" / "tritonserver" / f"py{version}-{key}" / "backends"
    if all((backends / "python" / name).resolve() == target.resolve() for name, target in targets.items()):
        return backends
    shutil.rmtree(backends, ignore_errors=True)  # stale links (pytriton reinstalled elsewhere)
    backends.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".backends-", dir=backends.parent))
    (staging / "python").mkdir()
    for name, target in targets.items():
        (staging / "python" / name).symlink_to(target)
    try:
        staging.rename(backends)
    except OSError:  # another launch made it first
        shutil.rmtree(staging)
    return backends


def server_environment(install: TritonInstallation, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: os.environ) plus what the server and its Python stubs need."""
    env = dict(os.environ if base is None else base)

    def prepend(name: str, *entries: Path) -> None:
        parts = [str(e) for e in entries] + [p for p in env.get(name, "").split(os.pathsep) if p]
        env[name] = os.pathsep.join(dict.fromkeys(parts))  # drop duplicates, keep order

    prepend("PATH", Path(sys.executable).parent)
    if install.library_dirs:
        prepend("LD_LIBRARY_PATH", *install.library_dirs)
    return env


def server_command(
    install: TritonInstallation,
    model_repo: Path,
    *,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The tritonserver argv for one model repository and three ports."""
    cmd = [
        str(install.binary),
        f"--model-repository={model_repo}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
    ]
    if install.backend_directory is not None:
        cmd.append(f"--backend-directory={install.backend_directory}")
    if install.cache_directory is not None:
        cmd.append(f"--cache-directory={install.cache_directory}")
    return cmd + list(extra_args)


@dataclass
class TritonServer:
    """A server started by :func:`start_server` (our child process)."""

    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_file: Path
    stub_watch: subprocess.Popen | None = None  # :mod:`.stub_watch`, when started

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        if self.stub_watch is not None:  # first: the stubs end while their models unload
            self.stub_watch.terminate()
            self.stub_watch.wait()
        stop_process(self.pid, timeout)
        self.process.wait()

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def start_server(
    model_repo: str | Path,
    *,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    log_file: str | Path,
    timeout: float = 300.0,
    extra_args: Sequence[str] = (),
    install: TritonInstallation | None = None,
    env: Mapping[str, str] | None = None,
    die_with_parent: bool = False,
    watch_stubs: bool = False,
) -> TritonServer:
    """Start tritonserver on ``model_repo`` and return once it is ready.

    Output goes to ``log_file`` (truncated). The server runs in its own session, so it
    outlives this process unless ``die_with_parent`` (handy in tests). ``watch_stubs``: once it
    is ready, start :mod:`.stub_watch` (its own session too, writing to the same log), which
    kills the server when one of its Python stub processes dies. Raises
    :class:`TritonServerError` with the log's last lines if the server exits or is not ready
    within ``timeout`` seconds (it is then stopped).
    """
    model_repo = Path(model_repo).resolve()
    if not model_repo.is_dir():
        raise TritonServerError(f"model repository {model_repo} is not a directory")
    ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
    _check_ports_free(ports)
    install = install or find_tritonserver()
    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = server_command(install, model_repo, http_port=http_port, grpc_port=grpc_port,
                         metrics_port=metrics_port, extra_args=extra_args)
    log_file.write_bytes(b"")
    preexec_fn = terminate_with_parent if die_with_parent else None
    with open(log_file, "ab") as log:  # appending: the stub watch writes to it too
        process = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=server_environment(install, env), start_new_session=True, preexec_fn=preexec_fn,
        )
    server = TritonServer(process, http_port, grpc_port, metrics_port, log_file)
    try:
        _wait_until_ready(server, timeout)
    except BaseException:
        server.stop(timeout=10.0)
        raise
    if watch_stubs:

        known = [arg for stub in python_stubs(process.pid).values()
                 for arg in ("--stub", str(stub.pid), stub.model, stub.instance)]
        with open(log_file, "ab") as log:
            server.stub_watch = subprocess.Popen(
                [sys.executable, "-m", "cosyserve.serving.stub_watch", "--server-pid", str(process.pid),
                 "--http-port", str(http_port), *known],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=preexec_fn)
    return server


MPS_CONTROL = "nvidia-cuda-mps-control"


@contextmanager
def mps_daemon(directory: Path) -> Iterator[dict[str, str]]:
    """A CUDA MPS control daemon of its own (pipes and logs under ``directory``), quit on exit;
    yields the environment variables its clients need. Benchmarks use it to run one server, or
    one set of processes, under MPS without touching a system-wide daemon (``run.sh`` stage 3
    manages the daemon of a deployment)."""
    binary = shutil.which(MPS_CONTROL)
    if binary is None:
        raise TritonServerError(f"CUDA MPS needs {MPS_CONTROL} on PATH (NVIDIA driver utilities); not found")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(directory / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(directory / "log")}
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env}
    started = subprocess.run([binary, "-d"], env=full_env, capture_output=True, text=True)
    if started.returncode:
        raise TritonServerError(f"{MPS_CONTROL} -d failed (exit {started.returncode}): {started.stderr.strip()}")
    try:
        yield env
    finally:
        subprocess.run([binary], input="quit\n", env=full_env, capture_output=True, text=True)


def _check_ports_free(ports: Mapping[str, int]) -> None:
    """Fail before launching if a port is taken: an old server there would answer our probe."""
    for name, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError as e:
                raise TritonServerError(
                    f"{name} port {port} is already in use ({e.strerror}); stop what listens there "
                    f"(an earlier server? `python -m cosyserve.serving.tritonserver stop --pid-file ...`) "
                    "or choose other ports"
                ) from None


def terminate_with_parent() -> None:
    """preexec_fn: have the kernel send SIGTERM to the server when its parent dies."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def is_ready(http_port: int, host: str = "127.0.0.1") -> bool:
    """Whether the server on ``http_port`` answers ``/v2/health/ready`` with 200."""
    try:
        with urllib.request.urlopen(f"http://{host}:{http_port}/v2/health/ready", timeout=2.0) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def serves_metrics(metrics_port: int, host: str = "127.0.0.1") -> bool:
    """Whether the server's Prometheus endpoint on ``metrics_port`` answers."""
    try:
        with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=2.0) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _wait_until_ready(server: TritonServer, timeout: float) -> None:
    # tritonserver opens its metrics endpoint after its HTTP one: health can say ready a moment
    # before /metrics answers, and callers (autoscalers, our tests) read metrics at once.
    deadline = time.monotonic() + timeout
    while True:
        returncode = server.process.poll()
        if returncode is not None:
            raise TritonServerError(
                f"tritonserver exited with code {returncode} before it was ready.\n{log_report(server.log_file)}"
            )
        if is_ready(server.http_port) and serves_metrics(server.metrics_port):
            return
        if time.monotonic() > deadline:
            raise TritonServerError(
                f"tritonserver was not ready after {timeout:.0f} s (models still loading? raise "
                f"--timeout).\n{log_report(server.log_file)}"
            )
        time.sleep(READY_POLL_S)


# Triton's error records ("E1121 02:58:27.511608 ...") and its final "error: ..." line.
_ERROR_LINE = re.compile(r"^(E\d{4} |error: )")


def log_report(log_file: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The error lines of a server log, then its last ``lines`` lines.

    The error lines come first because the end of a failed start is mostly the option table.
    """
    try:
        text = Path(log_file).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"(no log at {log_file})"
    errors = [line for line in text if _ERROR_LINE.match(line)]
    report = f"errors in {log_file}:\n" + "\n".join(errors) + "\n" if errors else ""
    return report + f"last {lines} lines of {log_file}:\n" + "\n".join(text[-lines:])


def stop_process(pid: int, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> None:
    """SIGTERM ``pid``; after ``timeout`` s SIGKILL its process group (it also holds the stubs)."""
    if not is_running(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while is_running(pid):
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)  # started with start_new_session: group id == pid
            except ProcessLookupError:
                pass
            break
        time.sleep(0.2)
    while is_running(pid) and time.monotonic() < deadline + 10.0:
        time.sleep(0.1)
    if is_running(pid):
        raise TritonServerError(f"tritonserver (pid {pid}) is still running after SIGKILL")


# --- pid files ---------------------------------------------------------------------------


def write_pid_file(path: str | Path, pid: int) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{pid}\n")


def read_pid_file(path: str | Path) -> int | None:
    """The pid in ``path``, or None when the file does not exist."""
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise TritonServerError(f"pid file {path} does not hold a process id: {text!r}")
    return int(text)


def _is_tritonserver(pid: int) -> bool:
    """Guard against pid reuse: only stop processes whose executable is tritonserver."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except FileNotFoundError:
        return False
    return Path(argv0.decode(errors="replace")).name == "tritonserver"


def stop_from_pid_file(pid_file: str | Path, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> str:
    """Stop the tritonserver recorded in ``pid_file`` and remove the file; returns what happened.

    A reused pid (not a tritonserver any more) is left alone (an error). The recipes' ``stop`` does
    the same in bash (scripts/lib.sh: stop_pid_file), which needs no Python environment.
    """
    pid = read_pid_file(pid_file)
    if pid is None:
        return f"no pid file {pid_file}: nothing to stop"
    if not is_running(pid):
        Path(pid_file).unlink()
        return f"tritonserver (pid {pid}) was not running; removed {pid_file}"
    if not _is_tritonserver(pid):
        raise TritonServerError(f"pid {pid} from {pid_file} is not a tritonserver process; not stopping it")
    stop_process(pid, timeout)
    Path(pid_file).unlink()
    return f"stopped tritonserver (pid {pid})"


# --- command line --------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cosyserve.serving.tritonserver", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="launch tritonserver and return when it is ready")
    start.add_argument("--model-repo", required=True, type=Path)
    start.add_argument("--http-port", type=int, default=8000)
    start.add_argument("--grpc-port", type=int, default=8001)
    start.add_argument("--metrics-port", type=int, default=8002)
    start.add_argument("--log", required=True, type=Path, help="server output (truncated)")
    start.add_argument("--pid-file", required=True, type=Path)
    start.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness")
    start.add_argument("--watch-stubs", action="store_true",
                       help="kill the server when one of its Python stub processes dies (cosyserve.serving.stub_watch)")
    start.add_argument("server_args", nargs="*", help="extra tritonserver arguments, after `--`")
    stop = commands.add_parser("stop", help="stop the server recorded in a pid file")
    stop.add_argument("--pid-file", required=True, type=Path)
    stop.add_argument("--timeout", type=float, default=DEFAULT_STOP_TIMEOUT_S,
                      help="seconds between SIGTERM and SIGKILL")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        if args.command == "stop":
            print(stop_from_pid_file(args.pid_file, args.timeout))
            return 0
        running = read_pid_file(args.pid_file)
        if running is not None and is_running(running) and _is_tritonserver(running):
            raise TritonServerError(f"tritonserver from {args.pid_file} is already running (pid {running}); stop it first")
        server = start_server(args.model_repo, http_port=args.http_port, grpc_port=args.grpc_port,
                              metrics_port=args.metrics_port, log_file=args.log, timeout=args.timeout,
                              extra_args=args.server_args, watch_stubs=args.watch_stubs)
        write_pid_file(args.pid_file, server.pid)
        print(f"tritonserver ready (pid {server.pid}): http {server.http_url}, grpc {server.grpc_url}, "
              f"metrics localhost:{server.metrics_port}; log {server.log_file}")
        return 0
    except TritonServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
