"""`stop` of the three recipes from a bare shell: no venv, no Python on PATH, only bash, a few
coreutils and the pid files. Stand-in processes (``sleep`` under the name a server runs as) take the
place of tritonserver, the API and the LLM servers."""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# What stopping may use besides bash's builtins (scripts/lib.sh and the recipes' preamble).
BARE_TOOLS = ("bash", "cat", "tr", "grep", "sleep", "date", "dirname", "rm")


@pytest.fixture
def bare_path(tmp_path) -> str:
    """A PATH of links to BARE_TOOLS alone: no python, no venv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in BARE_TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


@pytest.fixture
def stand_ins():
    """start(name, ignore_term=False): a process in a session of its own whose argv[0] is ``name``
    (what the recipes check before signalling), as the recipes start servers; reaped afterwards."""
    processes = []

    def start(name: str, ignore_term: bool = False) -> subprocess.Popen:
        trap = "trap '' TERM; " if ignore_term else ""  # an ignored signal stays ignored across exec
        process = subprocess.Popen(["bash", "-c", f"{trap}exec -a {name} sleep 300"], start_new_session=True)
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def running(process: subprocess.Popen) -> bool:
    """Alive and not a zombie (a stopped stand-in stays one until this test reaps it)."""
    try:
        state = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def write_pid(path: Path, process: subprocess.Popen) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{process.pid}\n")
    return path


def bare_stop(script: str, path: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    full_env = {"PATH": path, "HOME": str(tmp_path), "VENV": str(tmp_path / "no_venv"),
                "OUT_DIR": str(tmp_path / "out"), "MPS_DIR": str(tmp_path / "mps"), "STOP_TIMEOUT_S": "2", **env}
    return subprocess.run([shutil.which("bash"), str(REPO_ROOT / script), "stop"], cwd=tmp_path, env=full_env,
                          capture_output=True, text=True, timeout=60)


def test_run_sh_stop_ends_the_api_triton_and_the_disaggregated_servers(bare_path, stand_ins, tmp_path):
    disagg = tmp_path / "disaggregated"
    api, triton, triton_1, llm_1 = (stand_ins("cosyserve.api"), stand_ins("tritonserver"),
                                    stand_ins("/opt/tritonserver/bin/tritonserver"), stand_ins("trtllm-serve"))
    stubborn = stand_ins("tritonserver", ignore_term=True)  # SIGKILL after STOP_TIMEOUT_S
    pid_files = [write_pid(tmp_path / "api.pid", api), write_pid(tmp_path / "triton.pid", triton),
                 write_pid(disagg / "tritonserver_1.pid", triton_1), write_pid(disagg / "tritonserver_2.pid", stubborn),
                 write_pid(disagg / "llm_server_1.pid", llm_1)]
    proc = bare_stop("run.sh", bare_path, tmp_path, API_PID_FILE=str(pid_files[0]), SERVER_PID_FILE=str(pid_files[1]),
                     DISAGG_DIR=str(disagg))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for process in (api, triton, triton_1, stubborn, llm_1):
        assert not running(process)
    assert not any(path.exists() for path in pid_files)
    assert f"stopped cosyserve API (pid {api.pid})" in proc.stdout
    assert f"stopped tritonserver (pid {stubborn.pid})" in proc.stdout
    assert "MPS" not in proc.stdout


def test_run_sh_stop_leaves_a_reused_pid_alone_and_stops_the_rest(bare_path, stand_ins, tmp_path):
    stranger, triton = stand_ins("sleep"), stand_ins("tritonserver")
    api_pid, triton_pid = write_pid(tmp_path / "api.pid", stranger), write_pid(tmp_path / "triton.pid", triton)
    gone = tmp_path / "gone.pid"
    gone.write_text("999999999\n")  # above any pid_max: a server that has exited
    proc = bare_stop("run.sh", bare_path, tmp_path, API_PID_FILE=str(api_pid), SERVER_PID_FILE=str(triton_pid),
                     DISAGG_DIR=str(tmp_path / "disaggregated"))
    assert proc.returncode == 1
    assert f"pid {stranger.pid} from {api_pid} is not a cosyserve API process; not stopping it" in proc.stderr
    assert running(stranger) and api_pid.exists()
    assert not running(triton) and not triton_pid.exists()
    proc = bare_stop("run.sh", bare_path, tmp_path, API_PID_FILE=str(gone), SERVER_PID_FILE=str(triton_pid),
                     DISAGG_DIR=str(tmp_path / "disaggregated"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cosyserve API (pid 999999999) was not running" in proc.stdout and not gone.exists()
    assert f"no pid file {triton_pid}: nothing to stop" in proc.stdout


def test_run_cosyvoice3_sh_stop_ends_triton(bare_path, stand_ins, tmp_path):
    triton = stand_ins("tritonserver")
    pid_file = write_pid(tmp_path / "triton.pid", triton)
    proc = bare_stop("run_cosyvoice3.sh", bare_path, tmp_path, SERVER_PID_FILE=str(pid_file))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not running(triton) and not pid_file.exists()


def test_dit_recipe_stop_ends_triton_and_the_llm_server(bare_path, stand_ins, tmp_path):
    disagg = tmp_path / "disaggregated"
    triton, triton_1, llm = stand_ins("tritonserver"), stand_ins("tritonserver"), stand_ins("trtllm-serve")
    pid_files = [write_pid(tmp_path / "triton.pid", triton), write_pid(disagg / "tritonserver_1.pid", triton_1),
                 write_pid(tmp_path / "llm.pid", llm)]
    proc = bare_stop("run_stepaudio2_dit_token2wav.sh", bare_path, tmp_path, SERVER_PID_FILE=str(pid_files[0]),
                     LLM_PID_FILE=str(pid_files[2]), DISAGG_DIR=str(disagg))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not any(running(p) for p in (triton, triton_1, llm)) and not any(path.exists() for path in pid_files)
    assert f"stopped the LLM server (pid {llm.pid})" in proc.stdout
