"""Bad input and faults, counted by class: how many cases got a clear error, were survived, crashed,
or were silently accepted (the goal: crash 0 and silently accepted 0 in every class).

Classes measured here:

* **bad configs**: every case of ``tests/config/test_bad_configs.py`` (the issue's review cases and
  earlier ones), loaded like ``megarl run`` loads a config. Clear: a ``ConfigError`` naming the
  expected key and value, on one line. Unclear: an error naming another key or missing the value.
* **bad dataset rows**: every kind of ``tests/data/test_bad_rows.py`` (missing, empty or mistyped
  fields, an unparsable answer, lines that are not JSON objects or not UTF-8), loaded with
  ``bad_rows: raise`` (clear: the error names file and row) and ``bad_rows: skip`` (survived: the
  good rows load, in order).
* **malformed server replies**: each fault of the fake vLLM server (``tests/rollout/fake_server.py``:
  HTTP 500, invalid JSON, a wrong shape, and complete replies that cannot be trained on: NaN,
  infinite or positive logprobs, a negative or non-integer token id, more tokens than asked,
  token and logprob lists of different lengths, an unknown finish reason, empty choices, no
  logprobs), once (survived: retried, and the sample equals the clean one) and on every attempt
  (clear: the request fails naming the server, the attempts and the fault).
* **damaged recover points**: a recover point whose manifest is missing or garbled, a file deleted
  or truncated after it was written, and a full disk during a dump (``RecoverHandler`` on a stub
  engine). Survived: recovery falls back to the previous point (or the dump fails with a message
  and the previous point stays loadable).

* **episodes failed by a bad reply**: each of those faults on every attempt of an episode's request
  (once for a 4xx that is not retried), through ``prepare_batch``. Survived: the pool runs the
  episode again, the batch comes back whole and clean, and ``rollout/n_failed`` counts it (a
  connection dropped on every attempt instead takes the server out of rotation for
  ``unhealthy_retry_interval``; the request waits that out and succeeds, so no episode fails).
* **under load**: the verdict of the last full run of ``benchmarks/pool_load.py`` (512 episodes
  for 30 minutes, 10% of requests delayed or failed; not rerun here), when one was recorded.

The malformed-reply class includes the transport faults: 5xx, 408/429, 400/404 (refused at
once), an empty body, an HTML page, a body cut short or reset mid-way, a hang and a trickle.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from collections import Counter
from pathlib import Path
from unittest import mock

from benchmarks._harness import main_for

TITLE = "Bad input and faults by class: crash 0 and silently accepted 0 in every class"
OUTCOMES = ("clear error", "unclear error", "survived", "crash", "silently accepted")


def run(quick: bool) -> list[dict]:
    requests, episodes = _reply_outcomes()
    rows = [
        _row("bad configs", _config_outcomes()),
        _row("bad dataset rows", _row_outcomes()),
        _row("malformed server replies", requests),
        _row("episodes failed by a bad reply", episodes),
        _row("damaged recover points", _recover_outcomes()),
    ]
    load = _load_row()
    return rows + ([load] if load else [])


def _row(name: str, outcomes: list[str]) -> dict:
    counts = Counter(outcomes)
    return {"class": name, "cases": len(outcomes), **{outcome: counts.get(outcome, 0) for outcome in OUTCOMES}}


def _config_outcomes() -> list[str]:
    from megarl.config import ConfigError, GRPOConfig
    from megarl.run.prelaunch import load_expr_config
    from tests.config.bad_files import write_bad_files
    from tests.config.test_bad_configs import BAD, CPU_YAML

    logging.getLogger("megarl").setLevel(logging.ERROR)
    outcomes = []
    # as the tests load them (tests/config/test_bad_configs.py): offline, so a hub id is an error here
    with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1"}):
        files = write_bad_files(Path(tmp))
        for case in BAD:
            overrides, key, fragment = case.values
            try:
                load_expr_config(["--config", CPU_YAML, *(o.replace("@files", files) for o in overrides)], GRPOConfig)
            except ConfigError as err:
                clear = err.key == key and fragment in str(err) and "\n" not in str(err)
                outcomes.append("clear error" if clear else "unclear error")
            except Exception:  # noqa: BLE001 - a traceback is what this class counts
                outcomes.append("crash")
            else:
                outcomes.append("silently accepted")
    return outcomes


def _row_outcomes() -> list[str]:
    from megarl.data import DatasetRowError, load_rl_dataset
    from tests.data.test_bad_rows import BAD, write

    outcomes = []
    for type, line, says in BAD.values():
        with tempfile.TemporaryDirectory() as tmp:
            path = write(Path(tmp), type, line)
            try:
                load_rl_dataset(path, "train", type=type)
                outcomes.append("silently accepted")
            except DatasetRowError as err:
                outcomes.append("clear error" if path in str(err) and says in str(err) else "unclear error")
            except Exception:  # noqa: BLE001
                outcomes.append("crash")
            outcomes.append(
                _survived(
                    lambda: list(load_rl_dataset(path, "train", type=type, bad_rows="skip")["answer"]) == ["1", "3"]
                )
            )
    return outcomes


def _reply_outcomes() -> tuple[list[str], list[str]]:
    """Each bad reply of the fake server, at the request and at the episode level."""
    from tests.rollout.conftest import start_fake_servers
    from tests.rollout.fake_server import CORRUPTIONS, TRANSPORT_FAULTS

    logs = tempfile.TemporaryDirectory(prefix="megarl-reliability-")
    (server,) = start_fake_servers(1, log_dir=Path(logs.name))
    requests, episodes = [], []
    try:
        for fault in [*TRANSPORT_FAULTS, *CORRUPTIONS]:
            refused_at_once = TRANSPORT_FAULTS.get(fault) in ("fail", "deadline")  # one attempt, then an error
            requests += _request_outcomes(server.address, fault, refused_at_once)
            episodes.append(_episode_outcome(server.address, fault, 1 if refused_at_once else 3))
    finally:
        server.stop()
        logs.cleanup()
    return requests, episodes


def _inject(address: str, fault: str, times: int) -> None:
    import json
    import urllib.request

    body = json.dumps({"faults": [fault] * times}).encode()
    urllib.request.urlopen(urllib.request.Request(f"http://{address}/_faults", data=body, method="POST"))


def _request_outcomes(address: str, fault: str, refused_at_once: bool) -> list[str]:
    """The fault once (survived: retried, the clean sample) and on every attempt (clear: the error
    names the server, the attempts and the fault); a 4xx that cannot be retried: one clear error."""
    import asyncio

    from megarl.api import ModelRequest
    from megarl.api.io_struct import GenerationHyperparameters
    from megarl.serving import InferenceServerError
    from tests.rollout.conftest import make_engine
    from tests.rollout.helpers import expected_tokens

    prompt = [101, 102, 103]

    def sample(engine) -> list[int]:
        request = ModelRequest(input_ids=prompt, gconfig=GenerationHyperparameters(max_new_tokens=8))
        return asyncio.run(engine.agenerate(request)).output_tokens

    outcomes = []
    engine = make_engine([address], request_retries=2, request_timeout=1.0, unhealthy_retry_interval=0.1)
    try:
        if not refused_at_once:
            _inject(address, fault, 1)
            outcomes.append(_survived(lambda: sample(engine) == expected_tokens(len(prompt), 8)[0]))
        _inject(address, fault, 1 if refused_at_once else 3)
        try:
            tokens = sample(engine)
        except InferenceServerError as err:
            tries = "after 1 attempt" if refused_at_once else "after 3 attempts"
            outcomes.append("clear error" if address in str(err) and tries in str(err) else "unclear error")
        except Exception:  # noqa: BLE001
            outcomes.append("crash")
        else:  # a connection fault on every attempt: the request waits out the server's outage
            outcomes.append("survived" if tokens == expected_tokens(len(prompt), 8)[0] else "silently accepted")
    finally:
        engine.destroy()
    return outcomes


_CONNECTION_FAULTS = ("truncated", "reset_mid_body", "disconnect")


def _episode_outcome(address: str, fault: str, times: int) -> str:
    """An episode whose request fails for good on ``fault``: survived when the pool runs it again and
    the batch comes back whole, clean and with the failure counted in the step metrics."""
    from megarl.utils import stats_tracker
    from tests.rollout.conftest import make_engine
    from tests.rollout.fake_server import TRANSPORT_FAULTS
    from tests.rollout.helpers import OneShotWorkflow, expected_tokens
    from tests.rollout.sim import ListLoader

    engine = make_engine(
        [address],
        batch_size=2,
        max_concurrent_rollouts=1,
        request_retries=2,
        request_timeout=1.0,
        unhealthy_retry_interval=0.1,
    )
    stats_tracker.export(local=True)
    _inject(address, fault, times)
    try:
        batch = engine.prepare_batch(ListLoader([{"id": i} for i in range(8)], 2), OneShotWorkflow(8, 5))
    except Exception:  # noqa: BLE001
        return "crash"
    finally:
        engine.destroy()
    stats = stats_tracker.export(local=True)
    tokens = expected_tokens(5, 8)[0]
    clean = sorted(batch["rewards"].tolist()) == [0.0, 1.0] and all(
        batch["input_ids"][row, 5:].tolist() == tokens for row in range(2)
    )
    # the failure is counted, unless the request itself survived it (a connection fault: the outage is waited out)
    counted = (
        stats.get("rollout/n_failed") == 1 or TRANSPORT_FAULTS.get(fault) == "retry" and fault in _CONNECTION_FAULTS
    )
    return "survived" if clean and counted else "silently accepted"


def _recover_outcomes() -> list[str]:
    import torch

    from tests.run.test_recover import dump, load

    damages = {
        "manifest missing": lambda point: (point / "MANIFEST.json").unlink(),
        "manifest garbled": lambda point: (point / "MANIFEST.json").write_text("{"),
        "file deleted": lambda point: (point / "model" / "version").unlink(),
        "file truncated": lambda point: (point / "model" / "version").write_text(""),
    }
    outcomes = []
    for damage in damages.values():
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp)
            dump(run_dir, 3)
            dump(run_dir, 4)
            damage(run_dir / "recover" / "step4")
            outcomes.append(_survived(lambda: load(run_dir)[1].global_step == 3))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, real_save = Path(tmp), torch.save
        dump(run_dir, 3)

        def disk_full(obj, path, *args, **kwargs):
            real_save(obj, path, *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")

        with mock.patch.object(torch, "save", disk_full):
            try:
                dump(run_dir, 4)
                outcomes.append("silently accepted")
            except OSError as err:
                clear = "no space left" in str(err) and "previous points are intact" in str(err)
                outcomes.append(_survived(lambda: load(run_dir)[1].global_step == 3) if clear else "unclear error")
    return outcomes


def _load_row() -> dict | None:
    """The load class from the last full run of ``benchmarks/pool_load.py`` (30 minutes: not rerun here)."""
    import json

    from benchmarks._harness import RESULTS_DIR

    path = RESULTS_DIR / "pool_load.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if record["quick"]:
        return None
    row = record["rows"][0]
    books = row["lost"] == 0 and row["doubled"] == 0 and row["misaligned"] == 0
    healthy = row["RSS growth %"] < 5 and row["drained"] and row["loop tasks after drain"] <= 2
    name = f"under load ({row['concurrency']} episodes, {row['minutes']} min, pool_load.md of {record['date'][:10]})"
    outcome = "survived" if books and healthy else "silently accepted" if not books else "crash"
    return _row(name, [outcome])


def _survived(recovered) -> str:
    try:
        return "survived" if recovered() else "silently accepted"
    except Exception:  # noqa: BLE001
        return "crash"


def summary(rows: list[dict]) -> str:
    bad = [r["class"] for r in rows if r["crash"] or r["silently accepted"]]
    return "every class: crash 0, silently accepted 0" if not bad else f"FAILING classes: {', '.join(bad)}"


if __name__ == "__main__":
    main_for(__name__)
