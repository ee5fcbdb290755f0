"""How trainer rank 0 drives the servers through one update while every trainer rank sends.

Servers that update in one call (vLLM's megarl route) get one each
(:class:`~megarl.bridge.update_round.UpdateRound`); the others three (begin, receive while the ranks send,
commit), each call fanned out to every server on the process's fan-out threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from megarl.bridge.update_round import UpdateRound
from megarl.config.bridge import WeightUpdateConfig
from megarl.serving import ServerControl, ServerRef
from megarl.utils import heartbeat
from megarl.utils.fanout import call_all


def in_threads(calls: dict[str, callable], timeout: float) -> dict[str, str]:
    """Run ``{name: fn}`` concurrently; ``{name: error}`` of those that raised or did not finish in time
    (on the process's fan-out threads: :func:`megarl.utils.fanout.call_all`)."""
    return call_all(calls, timeout)


def in_background(calls: dict[str, callable], timeout: float, errors: dict[str, str]) -> threading.Thread:
    """A started thread running :func:`in_threads` on ``calls``; their errors land in ``errors``."""
    thread = threading.Thread(
        target=lambda: errors.update(in_threads(calls, timeout)), daemon=True, name="megarl-bridge-control"
    )
    thread.start()
    return thread


def drive(
    servers: list[ServerControl | ServerRef],
    mode: str,
    path: str | None,
    version: int,
    config: WeightUpdateConfig,
    send: Callable[[], None] | None,
    driver: bool,
) -> tuple[dict[str, str], float]:
    """One update of ``servers`` to ``version`` (``path``: disk mode's directory): the ``driver`` (rank 0)
    calls the servers, every rank runs ``send`` (None: nothing to send). Returns ``{address: why}`` of the
    servers that failed and the seconds the commit took (both empty on the other ranks)."""
    if not all(s.one_call_update for s in servers):
        return _drive_in_phases(servers, mode, path, version, config, send, driver)
    round_ = None
    if driver:
        heartbeat.step(f"weight sync: {mode} update of {len(servers)} server(s), one call each")
        # each server generates again once it committed; the heads hold their requests until they have the version
        round_ = UpdateRound(servers, mode, path, version, config, resume=True)
        round_.start()
        heartbeat.step("weight sync: waiting for the servers to pause")
        round_.wait_paused()  # the one barrier before the transfer: every receiver is about to post
    if send is not None:
        heartbeat.step(f"weight sync: sending ({mode})")
        send()
    if round_ is None:
        return {}, 0.0
    heartbeat.step("weight sync: waiting for the servers to commit")
    start = time.perf_counter()
    failed = round_.wait_committed()
    return failed, time.perf_counter() - start


def _drive_in_phases(servers, mode, path, version, config, send, driver) -> tuple[dict[str, str], float]:
    """:func:`drive` in three calls per server: begin, receive while ``send`` runs, commit."""
    failed: dict[str, str] = {}
    receiving, commit_seconds = None, 0.0
    timeout = config.update_timeout
    if driver:
        heartbeat.step(f"weight sync: {mode} update begins on {len(servers)} server(s)")
        failed.update(in_threads({s.address: (lambda s=s: s.begin(mode)) for s in servers}, timeout))
        live = [s for s in servers if s.address not in failed]
        receiving = in_background({s.address: (lambda s=s: s.receive(mode, path)) for s in live}, timeout, failed)
    if send is not None:
        heartbeat.step(f"weight sync: sending ({mode})")
        send()
    if driver:
        heartbeat.step("weight sync: waiting for the servers to receive")
        receiving.join()
        ready = [s for s in servers if s.address not in failed]
        heartbeat.step(f"weight sync: commit on {len(ready)} server(s)")
        start = time.perf_counter()
        failed.update(in_threads({s.address: (lambda s=s: s.commit(version)) for s in ready}, timeout))
        commit_seconds = time.perf_counter() - start
    return failed, commit_seconds
