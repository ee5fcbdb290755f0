"""A fake vLLM server (one TP rank) speaking vLLM 0.32's weight-update routes through megarl's receiver core.

``python fake_vllm.py --port P [--die-after-buckets N | --stall-after-buckets N --marker PATH]``,
or ``--ports P1,P2,...`` for plain servers in processes forked from one.
The routes and the two-phase life cycle are those of megarl's vLLM engine (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``), the receiving is
megarl's :class:`~megarl.bridge.receiver.WorkerReceiver`; the "model" is a dict of
tensors. ``--die-after-buckets N`` makes the process exit abruptly after taking in ``N``
buckets of an update (a server dying mid-transfer); ``--stall-after-buckets N`` makes it stop
receiving there instead, write its pid to ``--marker`` and wait to be killed from outside
(``SIGKILL``, a crash the process itself has no part in). ``--die-in-update`` picks the update of
either. ``POST /fake/dump {"path"}`` saves the committed tensors and version.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import torch
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megarl.bridge.receiver import ReceiverInit, WorkerReceiver, write_pieces
from megarl.bridge.transport_disk import iter_checkpoint
from megarl.serving.vllm import UPDATE_ROUTE
from tests.rollout.fake_server import serve_update_route


class FakeVLLM:
    def __init__(
        self, die_after: int | None, die_in_update: int, stall_after: int | None = None, marker: str | None = None
    ):
        self.die_after, self.die_in_update, self.updates = die_after, die_in_update, 0
        self.stall_after, self.marker = stall_after, marker
        self.receiver: WorkerReceiver | None = None
        self.staged: list = []
        self.weights: dict = {}
        self.version: str | None = None
        self.inits = 0
        """How many times the trainer initialised this server (joined it to new groups)."""

    def init(self, info: dict) -> None:
        self.inits += 1
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = WorkerReceiver(ReceiverInit(**info), tp_rank=0, device="cpu")
        self.receiver.connect()

    def update(self, info: dict) -> None:
        self.updates += 1
        if info["mode"] == "disk":
            self.staged = [("disk", info["path"])]
            return
        dying = self.die_after is not None and self.updates == self.die_in_update
        stalling = self.stall_after is not None and self.updates == self.die_in_update
        for n, part in enumerate(self.receiver.stream(info["mode"]), start=1):
            self.staged.append(
                ("named", [(k, t.clone()) for k, t in part.named])
                if part.named is not None
                else ("pieces", [(*p[:4], p[4].clone()) for p in part.pieces])
            )
            if dying and n >= self.die_after:
                os._exit(17)  # a crash mid-transfer: no cleanup, sockets reset
            if stalling and n >= self.stall_after:
                _stall(self.marker)

    def finish(self, version: str) -> None:
        specs = self.receiver.tensor_specs() if self.receiver else []
        for kind, data in self.staged:
            if kind == "disk":
                self.weights.update({n: t.clone() for n, t in iter_checkpoint(data)})
            elif kind == "named":
                self.weights.update(dict(data))
            else:
                targets = [
                    self.weights.setdefault((name, expert), torch.zeros(shape, dtype=torch.bfloat16))
                    for name, expert, shape, _ in specs
                ]
                write_pieces(targets, data, [None] * len(specs))
        self.staged, self.version = [], version


def _stall(marker: str) -> None:
    """Stop receiving mid-transfer: announce this process's pid in ``marker`` and block until killed."""
    tmp = Path(f"{marker}.tmp")
    tmp.write_text(str(os.getpid()))
    tmp.rename(marker)  # the watcher never reads a half-written pid
    threading.Event().wait()


def make_app(server: FakeVLLM) -> web.Application:
    app = web.Application(client_max_size=2**30)

    async def run(fn, *args):
        try:
            await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        except Exception as e:  # noqa: BLE001 (reported to the trainer like vLLM's 500 replies)
            return web.json_response({"error": {"message": f"{type(e).__name__}: {e}"}}, status=500)
        return web.json_response({"message": "ok"})

    async def body(request):
        return await request.json() if request.can_read_body else {}

    app.router.add_get("/health", lambda r: web.json_response({}))
    app.router.add_post(
        "/init_weight_transfer_engine", lambda r: _call(r, body, lambda b: run(server.init, b["init_info"]))
    )
    app.router.add_post("/start_weight_update", lambda r: web.json_response({"message": "started"}))
    app.router.add_post("/update_weights", lambda r: _call(r, body, lambda b: run(server.update, b["update_info"])))
    app.router.add_post(
        "/finish_weight_update", lambda r: _call(r, body, lambda b: run(server.finish, b["weight_version"]))
    )

    app.router.add_post(UPDATE_ROUTE, lambda r: serve_update_route(r, _Steps(server)))

    async def dump(request):
        dump = {"weights": server.weights, "version": server.version, "inits": server.inits}
        torch.save(dump, (await request.json())["path"])
        return web.json_response({})

    app.router.add_post("/fake/dump", dump)
    return app


class _Steps:
    """The fake's steps of megarl's one-call update (``megarl.serving.vllm_route.UpdateSteps``): it generates
    nothing, so pausing has nothing to abort."""

    def __init__(self, server: FakeVLLM):
        self.server = server

    async def pause(self) -> None:
        pass

    async def start(self) -> None:
        pass

    async def receive(self, mode: str, path: str | None) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.server.update, {"mode": mode, "path": path})

    async def finish(self, version: str) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.server.finish, version)

    async def resume(self) -> None:
        pass


async def _call(request, body, handler):
    return await handler(await body(request))


def _serve(port: int, server: FakeVLLM) -> None:
    web.run_app(make_app(server), host="127.0.0.1", port=port, print=lambda *a: None)


def _fleet(ports: list[int]) -> None:
    """One plain server process per port, forked from this one once torch is imported (16 servers start
    in seconds on two cores instead of importing torch 16 times). Each is a process of its own (own pid,
    sockets and bridge groups); this one waits for them, and they end with it."""
    children = []
    for port in ports:
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: gone with the parent
                logging.getLogger().handlers[0].setFormatter(logging.Formatter(f"[{port}] %(levelname)s %(message)s"))
                _serve(port, FakeVLLM(None, 1))
            finally:
                os._exit(0)
        children.append(pid)

    def stop(signum, frame):
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    for _ in children:
        with contextlib.suppress(ChildProcessError):
            os.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--ports", default=None, help="comma-separated: a plain server on each, forked (_fleet)")
    parser.add_argument("--die-after-buckets", type=int, default=None)
    parser.add_argument("--die-in-update", type=int, default=1, help="which update (1-based) to die or stall in")
    parser.add_argument("--stall-after-buckets", type=int, default=None)
    parser.add_argument("--marker", default=None, help="--stall-after-buckets: where to write the pid when stalled")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    if args.ports:
        _fleet([int(p) for p in args.ports.split(",")])
        return
    _serve(args.port, FakeVLLM(args.die_after_buckets, args.die_in_update, args.stall_after_buckets, args.marker))


if __name__ == "__main__":
    main()
