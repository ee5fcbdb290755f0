"""Elastic trainer threads: every core in phases where the servers have no work, the share otherwise."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megarl.utils import threads as thread_policy
from megarl.utils.threads import TrainerThreads


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _seen(threads: TrainerThreads, **kwargs) -> int:
    with threads.phase(**kwargs):
        return torch.get_num_threads()


def test_elastic_takes_every_core_only_while_servers_idle(one_thread):
    busy = {"idle": False}
    threads = TrainerThreads("elastic", share=1, machine=2, servers_idle=lambda: busy["idle"])
    assert _seen(threads) == 1  # the server is generating: keep the share
    assert _seen(threads, servers_paused=True) == 2  # weight sync: servers paused
    busy["idle"] = True
    assert _seen(threads) == 2
    assert torch.get_num_threads() == 1, "the share is restored after the phase"


def test_restored_after_an_error(one_thread):
    threads = TrainerThreads("elastic", share=1, machine=2, servers_idle=lambda: True)
    with pytest.raises(RuntimeError), threads.phase():
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 1


def test_static_and_gpu_never_change_threads(one_thread):
    assert _seen(TrainerThreads("static", share=1, machine=2, servers_idle=lambda: True), servers_paused=True) == 1
    gpu = TrainerThreads.for_this_rank("elastic", on_cpu=False, servers_idle=lambda: True)
    assert _seen(gpu, servers_paused=True) == 1


def test_machine_share_is_split_among_local_ranks(one_thread, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    threads = TrainerThreads.for_this_rank("elastic", on_cpu=True, servers_idle=None)
    assert (threads.share, threads.machine) == (1, 2)
    assert _seen(threads) == 1 and _seen(threads, servers_paused=True) == 2


_TWO_THREADS = """
import json, os, threading, torch
from megarl.utils.threads import set_compute_threads

def tasks():
    return len(os.listdir("/proc/self/task"))

set_compute_threads(2)
torch.randn(1 << 22).add_(1)  # the caller computes on two threads: its OpenMP team starts here
ready, done, seen = threading.Event(), threading.Event(), {}

def other():  # as a gloo thread copying a gradient bucket does
    before = tasks()
    torch.randn(1 << 22).add_(1)
    seen.update(threads=torch.get_num_threads(), started=tasks() - before)
    ready.set()
    done.wait()  # alive, as gloo's threads are for the whole run

thread = threading.Thread(target=other)
thread.start()
ready.wait()
print(json.dumps({"caller": torch.get_num_threads(), **seen}))
done.set()
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info(),
    reason="the libgomp build of torch (Linux); elsewhere set_compute_threads is torch.set_num_threads",
)
def test_only_the_caller_computes_on_several_threads():
    """Another thread's operator runs on one thread and starts no OpenMP team of its own (a second team
    makes libgomp stop spinning between parallel regions, process-wide)."""
    out = subprocess.run([sys.executable, "-c", _TWO_THREADS], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["caller"] == 2
    assert seen["threads"] == 1 and seen["started"] == 0, seen


def test_a_runtime_that_ignores_the_thread_count_falls_back_to_torch(one_thread, monkeypatch, caplog):
    """If the libgomp found is not the one torch computes with, the caller still gets its threads."""
    monkeypatch.setattr(thread_policy, "_thread_local_setters", lambda: (lambda n: None,))
    thread_policy.set_compute_threads(2)
    assert torch.get_num_threads() == 2
    assert "could not set this thread's OpenMP count" in caplog.text
