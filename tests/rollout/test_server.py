"""Server launch: commands from config, health wait, errors with log tails, process-tree cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from megarl.config.rollout import InferenceEngineConfig, VLLMConfig
from megarl.serving import (
    InferenceServer,
    LaunchSpec,
    ServerLaunchError,
    launch_servers,
    resolve_server_addrs,
    vllm_launch_spec,
)
from megarl.serving.http import SERVER_KEEPALIVE_S
from megarl.utils.hardware import auto_dtype
from megarl.utils.network import find_free_ports

pytestmark = pytest.mark.usefixtures("run_key")  # servers are launched with the run's key


def test_vllm_command_tp1_cpu():
    spec = vllm_launch_spec(VLLMConfig(max_model_len=512, extra_args=["--swap-space", "1"]), "/m", "127.0.0.1", 8000)
    assert spec.cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    cmd = " ".join(spec.cmd)
    for part in (
        "--model /m",
        "--port 8000",
        "--max-model-len 512",
        f"--dtype {auto_dtype('cpu')[0]}",  # dtype auto: this machine's choice
        "--enforce-eager",
        "--logprobs-mode processed_logprobs",
        "--swap-space 1",
    ):
        assert part in cmd
    assert "--tensor-parallel-size" not in cmd and "--gpu-memory-utilization" not in cmd
    assert spec.env == {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(SERVER_KEEPALIVE_S),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_API_KEY": "test-run-key",
    }
    assert spec.scratch_env == ("VLLM_RPC_BASE_PATH",)  # where vLLM puts its ZMQ sockets
    assert "--middleware megarl.utils.auth.RequireApiKey" in cmd and "test-run-key" not in cmd  # not in ps
    assert spec.address == "127.0.0.1:8000"


def test_vllm_dev_mode_server_without_a_key_only_when_told_insecure(monkeypatch):
    from megarl.utils.auth import API_KEY_ENV, INSECURE_ENV

    monkeypatch.delenv(API_KEY_ENV)
    with pytest.raises(ValueError, match="refusing to start vLLM server 0 on 192.0.2.9, an address other machines"):
        vllm_launch_spec(VLLMConfig(), "/m", "192.0.2.9", 8000)
    spec = vllm_launch_spec(VLLMConfig(), "/m", "127.0.0.1", 8000, insecure=True)
    assert spec.env[INSECURE_ENV] == "1" and "VLLM_API_KEY" not in spec.env
    assert "megarl.utils.auth.RequireApiKey" in spec.cmd  # it still answers /health only without INSECURE_ENV


def test_a_server_from_library_code_on_loopback_is_guarded_by_a_key_made_for_the_process(monkeypatch):
    """As a notebook starts one: no launcher, no key set, no ``insecure``."""
    from megarl.utils.auth import API_KEY_ENV, INSECURE_ENV, auth_headers

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    spec = vllm_launch_spec(VLLMConfig(), "/m", "127.0.0.1", 8000)
    key = os.environ[API_KEY_ENV]
    assert spec.env["VLLM_API_KEY"] == key and INSECURE_ENV not in spec.env
    assert auth_headers() == {"Authorization": f"Bearer {key}"}  # what this process's clients send


def test_vllm_command_tp2_cpu_and_cuda():
    cpu = vllm_launch_spec(VLLMConfig(), "/m", "127.0.0.1", 8000, tp=2)
    assert "--tensor-parallel-size 2 --distributed-executor-backend mp" in " ".join(cpu.cmd)
    assert cpu.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    pinned = vllm_launch_spec(VLLMConfig(), "/m", "127.0.0.1", 8000, tp=2, devices=[4, 5, 6, 7])
    assert pinned.env["VLLM_CPU_OMP_THREADS_BIND"] == "4,5|6,7"
    gpu = vllm_launch_spec(
        VLLMConfig(seed=5), "/m", "0.0.0.0", 8000, tp=2, devices=[2, 3], device_type="cuda", replica=1
    )
    assert gpu.env["CUDA_VISIBLE_DEVICES"] == "2,3" and "VLLM_CPU_KVCACHE_SPACE" not in gpu.env
    assert "--gpu-memory-utilization 0.85" in " ".join(gpu.cmd) and "--seed 6" in " ".join(gpu.cmd)
    with pytest.raises(ValueError, match="device_type"):
        vllm_launch_spec(VLLMConfig(), "/m", "h", 1, device_type="tpu")
    with pytest.raises(ValueError, match="at least 2 cores"):
        vllm_launch_spec(VLLMConfig(), "/m", "h", 1, tp=2, devices=[0])


def test_vllm_colocated_gpu_server_starts_in_sleep_mode():
    """Colocated on CUDA: ``--enable-sleep-mode`` (vLLM's /sleep frees GPU memory only with it; vLLM's own
    parser reads the flag); on CPU vLLM refuses the flag and /sleep only pauses, so it is left out."""
    gpu = vllm_launch_spec(VLLMConfig(), "/m", "h", 1, device_type="cuda", devices=[0], colocated=True)
    assert "--enable-sleep-mode" in gpu.cmd
    assert "--enable-sleep-mode" not in vllm_launch_spec(VLLMConfig(), "/m", "h", 1, device_type="cuda").cmd
    assert "--enable-sleep-mode" not in vllm_launch_spec(VLLMConfig(), "/m", "h", 1, colocated=True).cmd
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(gpu.cmd[3:])
    assert args.enable_sleep_mode is True and args.model == "/m"


def test_vllm_serving_lora_adapters_enables_runtime_loading():
    """Adapter weight sync: LoRA on, the smallest rank vLLM offers at or above the adapters', two adapters in a
    batch, the runtime load routes on; vLLM's own parser and LoRA config accept the flags."""
    assert "--enable-lora" not in vllm_launch_spec(VLLMConfig(), "/m", "h", 1).cmd
    spec = vllm_launch_spec(VLLMConfig(), "/m", "h", 1, lora_rank=12)
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "--max-lora-rank 16" in " ".join(spec.cmd)
    with pytest.raises(ValueError, match="up to 512, not 600"):
        vllm_launch_spec(VLLMConfig(), "/m", "h", 1, lora_rank=600)
    pytest.importorskip("vllm")
    from vllm.config.lora import LoRAConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(spec.cmd[3:])
    assert args.enable_lora is True
    LoRAConfig(max_lora_rank=args.max_lora_rank, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras)


def test_vllm_block_size_is_passed_and_checked_for_the_device():
    assert "--block-size" not in vllm_launch_spec(VLLMConfig(), "/m", "h", 1).cmd  # vLLM's default
    cpu = vllm_launch_spec(VLLMConfig(block_size=32), "/m", "h", 1)
    assert "--block-size 32" in " ".join(cpu.cmd)
    gpu = vllm_launch_spec(VLLMConfig(block_size=16), "/m", "h", 1, device_type="cuda")
    assert "--block-size 16" in " ".join(gpu.cmd)
    with pytest.raises(ValueError, match="vllm.block_size=16: vLLM-CPU needs a multiple of 32"):
        vllm_launch_spec(VLLMConfig(block_size=16), "/m", "h", 1)
    with pytest.raises(ValueError, match="block_size"):
        VLLMConfig(block_size=24).check()


def _python_spec(code: str, port: int = 1) -> LaunchSpec:
    return LaunchSpec(cmd=[sys.executable, "-c", textwrap.dedent(code)], port=port)


def test_server_that_dies_raises_with_log_tail(tmp_path):
    server = InferenceServer(
        _python_spec("print('loading weights'); print('CUDA out of memory'); raise SystemExit(3)"), tmp_path / "s.log"
    ).start()
    with pytest.raises(ServerLaunchError, match="exited with code 3") as info:
        server.wait_until_healthy(30)
    assert "CUDA out of memory" in str(info.value) and str(tmp_path / "s.log") in str(info.value)


def test_server_past_deadline_is_stopped(tmp_path):
    server = InferenceServer(
        _python_spec("import time; print('still starting', flush=True); time.sleep(600)"), tmp_path / "s.log"
    ).start()
    with pytest.raises(ServerLaunchError, match="not healthy within 1s") as info:
        server.wait_until_healthy(1)
    assert "still starting" in str(info.value)
    assert server.proc.returncode is not None, "the server must be stopped after a failed start"


_PARENT = """
import sys, time
from megarl.serving import InferenceServer, LaunchSpec
child = '''
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(g.pid, flush=True)
time.sleep(600)
'''
server = InferenceServer(LaunchSpec(cmd=[sys.executable, "-c", child], port=1), sys.argv[1]).start()
print(server.proc.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])  # SIGKILL: the keeper
def test_parent_signal_terminates_server_tree(tmp_path, sig):
    log = tmp_path / "child.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(log)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        server_pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 30
        while not log.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild_pid = int(log.read_text().split()[0])
        procs = [psutil.Process(server_pid), psutil.Process(grandchild_pid)]
        parent.send_signal(sig)
        parent.wait(30)
        _, alive = psutil.wait_procs(procs, timeout=15)
        assert not alive, f"server processes outlived their parent: {alive}"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_context_manager_stops_server(tmp_path):
    port = find_free_ports(1)[0]
    code = f"""
    import http.server
    http.server.HTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler).serve_forever()
    """
    spec = LaunchSpec(cmd=[sys.executable, "-c", textwrap.dedent(code)], port=port, health_endpoint="/")
    with InferenceServer(spec, tmp_path / "s.log").start() as server:
        server.wait_until_healthy(30)
        assert server.is_healthy()
    assert server.proc.returncode is not None and not server.is_healthy(timeout=1)


_SCRATCH_SERVER = """
import http.server, os, socket
where = os.environ["MEGARL_TEST_SOCKETS"]
socket.socket(socket.AF_UNIX).bind(os.path.join(where, "engine.sock"))  # as vLLM's ZMQ sockets, never unlinked
http.server.HTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def _scratch_server_spec() -> LaunchSpec:
    """A server that binds a socket in ``$MEGARL_TEST_SOCKETS``, its scratch variable."""
    port = find_free_ports(1)[0]
    cmd = [sys.executable, "-c", _SCRATCH_SERVER.format(port=port)]
    return LaunchSpec(cmd=cmd, port=port, health_endpoint="/", scratch_env=("MEGARL_TEST_SOCKETS",))


@pytest.mark.parametrize("how", ["stop", "server died"])
def test_server_scratch_directory_is_removed_when_it_stops(tmp_path, how):
    spec = _scratch_server_spec()
    server = InferenceServer(spec, tmp_path / "s.log", name="scratchy").start()
    try:
        server.wait_until_healthy(30)
        scratch = server.proc.scratch
        assert os.path.basename(scratch).startswith("megarl-scratchy-") and os.listdir(scratch) == ["engine.sock"]
        if how == "server died":  # the keeper removes it once the tree is gone, with nobody calling stop
            os.kill(server.pid, signal.SIGKILL)
            server.proc.wait(30)
            assert not os.path.exists(scratch), "the keeper left a dead server's scratch directory"
    finally:
        server.stop()
    assert not os.path.exists(scratch)


def test_server_scratch_variable_set_by_the_user_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_SOCKETS", str(tmp_path))
    spec = _scratch_server_spec()
    with InferenceServer(spec, tmp_path / "s.log").start() as server:
        server.wait_until_healthy(30)
        assert server.proc.scratch is None
    assert (tmp_path / "engine.sock").exists(), "the user's own directory is theirs"


def test_resolve_server_addrs(monkeypatch):
    assert resolve_server_addrs(InferenceEngineConfig(server_addrs=["a:1", "b:2"])) == ["a:1", "b:2"]
    monkeypatch.setenv("MY_ADDRS", "h1:10, h2:20")
    assert resolve_server_addrs(InferenceEngineConfig(server_addrs_env="MY_ADDRS")) == ["h1:10", "h2:20"]
    monkeypatch.setenv("MY_ADDRS", "h1")
    with pytest.raises(ValueError, match="MY_ADDRS"):
        resolve_server_addrs(InferenceEngineConfig(server_addrs_env="MY_ADDRS"))


def test_servers_started_the_areal_way_are_found(monkeypatch):
    """AReaL's ``AREAL_LLM_SERVER_ADDRS`` is read when megarl's variable is unset or empty; megarl's wins."""
    monkeypatch.delenv("MEGARL_LLM_SERVER_ADDRS", raising=False)
    monkeypatch.setenv("AREAL_LLM_SERVER_ADDRS", "h1:10,h2:20")
    assert resolve_server_addrs(InferenceEngineConfig()) == ["h1:10", "h2:20"]
    monkeypatch.setenv("MEGARL_LLM_SERVER_ADDRS", " ")
    assert resolve_server_addrs(InferenceEngineConfig()) == ["h1:10", "h2:20"]
    monkeypatch.setenv("MEGARL_LLM_SERVER_ADDRS", "h3:30")
    assert resolve_server_addrs(InferenceEngineConfig()) == ["h3:30"]
    monkeypatch.setenv("MEGARL_LLM_SERVER_ADDRS", "")
    monkeypatch.setenv("AREAL_LLM_SERVER_ADDRS", "h1")
    with pytest.raises(ValueError, match=r"AREAL_LLM_SERVER_ADDRS='h1'"):
        resolve_server_addrs(InferenceEngineConfig())
    monkeypatch.delenv("AREAL_LLM_SERVER_ADDRS")
    with pytest.raises(ValueError, match=r"no inference servers: .*MEGARL_LLM_SERVER_ADDRS"):
        resolve_server_addrs(InferenceEngineConfig())


def _http_spec(port: int) -> LaunchSpec:
    code = f"""
    import http.server
    http.server.HTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler).serve_forever()
    """
    return LaunchSpec(cmd=[sys.executable, "-c", textwrap.dedent(code)], port=port, health_endpoint="/")


def test_launch_servers_starts_all_or_none(tmp_path):
    ports = find_free_ports(2)
    servers = launch_servers([_http_spec(p) for p in ports], timeout=30, log_dir=tmp_path)
    try:
        assert [s.address for s in servers] == [f"127.0.0.1:{p}" for p in ports]
        assert all(s.is_healthy() for s in servers)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["server-0.log", "server-1.log"]
    finally:
        for server in servers:
            server.stop()
    good = _http_spec(find_free_ports(1)[0])
    bad = _python_spec("raise SystemExit('bad model path')")
    with pytest.raises(ServerLaunchError, match="bad model path"):
        launch_servers([good, bad], timeout=30, log_dir=tmp_path / "second")
    assert not InferenceServer(good).is_healthy(timeout=1), "the healthy one must be stopped too"
