"""Servers the launcher restarted, as the trainer learns of them.

A launcher (``megarl run``, the sbatch script) that restarts a dead inference server in its slot
appends a line to ``{run_dir}/server_restarts.jsonl`` (``{"server", "address", "restart", ...}``).
The restarted server answers at the same address but holds the model's first weights: the rollout
engine reads the file and keeps that server out of rotation until the trainer's weight sync has
pushed the current weights and version to it (:meth:`ServerSet.update_plan`).

Elastic servers work the same way through ``{run_dir}/servers_joined.jsonl``: ``megarl serve --join
RUN_DIR`` appends ``{"event": "join", "address", ...}`` once its server is healthy (the engine adds
it, out of rotation until the next weight sync pushes the current weights), and ``{"event":
"leave", ...}`` when it is stopped (the engine drains it: no new request, the bridge lets it go).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)

RESTARTS_FILE = "server_restarts.jsonl"
JOINS_FILE = "servers_joined.jsonl"
_POLL_S = 1.0


class RestartLog:
    """The new lines of ``{run_dir}/server_restarts.jsonl`` (or another such file), read at most once per ``poll_s``."""

    def __init__(self, run_dir: str | Path, poll_s: float = _POLL_S, name: str = RESTARTS_FILE):
        self.path = Path(run_dir) / name
        self.poll_s = poll_s
        self._offset = self.path.stat().st_size if self.path.exists() else 0  # earlier trainers' restarts are done
        self._next_poll = 0.0

    def new_addresses(self) -> list[str]:
        """Addresses of the servers restarted since the last call (``[]`` between polls)."""
        return [record["address"] for record in self.new_records()]

    def new_records(self) -> list[dict]:
        """The lines appended since the last call, each a dict with an ``address`` (``[]`` between polls)."""
        now = time.monotonic()
        if now < self._next_poll:
            return []
        self._next_poll = now + self.poll_s
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
        self._offset += len(complete)
        records = []
        for line in complete.decode(errors="replace").splitlines():
            try:
                record = json.loads(line)
                if not isinstance(record.get("address"), str):
                    raise TypeError("no address")
                records.append(record)
            except (json.JSONDecodeError, AttributeError, TypeError):
                logger.warning("ignoring a malformed line of %s: %r", self.path, line)
        return records


def append_record(path: Path, record: dict) -> None:
    """Append one JSON line (a single write, so a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
