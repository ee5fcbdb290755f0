"""Bad input and faults, counted by class: how many cases got a clear error, were survived, crashed,
or were silently accepted (issue 20's acceptance: crash 0 and silently accepted 0 in every class).

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

The 4xx, hang, trickle and reset-mid-body replies, counted episode failures in the step metrics,
and the load class come with the rest of item 2 and item 6.
"""

from __future__ import annotations

import errno
import logging
import tempfile
from collections import Counter
from pathlib import Path
from unittest import mock

from benchmarks._harness import main_for

TITLE = "Bad input and faults by class (issue 20): crash 0 and silently accepted 0 in every class"
OUTCOMES = ("clear error", "unclear error", "survived", "crash", "silently accepted")


def run(quick: bool) -> list[dict]:
    return [_row("bad configs", _config_outcomes()), _row("bad dataset rows", _row_outcomes()),
            _row("malformed server replies", _reply_outcomes()), _row("damaged recover points", _recover_outcomes())]


def _row(name: str, outcomes: list[str]) -> dict:
    counts = Counter(outcomes)
    return {"class": name, "cases": len(outcomes), **{outcome: counts.get(outcome, 0) for outcome in OUTCOMES}}


def _config_outcomes() -> list[str]:
    from megarl.config import ConfigError, GRPOConfig, load_expr_config
    from tests.config.bad_files import write_bad_files
    from tests.config.test_bad_configs import BAD, CPU_YAML

    logging.getLogger("megarl").setLevel(logging.ERROR)
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
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
            outcomes.append(_survived(lambda: list(load_rl_dataset(path, "train", type=type, bad_rows="skip")["answer"])
                                      == ["1", "3"]))  # fmt: skip
    return outcomes


def _reply_outcomes() -> list[str]:
    import asyncio
    import json
    import urllib.request

    from megarl.api import ModelRequest
    from megarl.config.rollout import GenerationHyperparameters
    from megarl.rollout import InferenceServerError
    from tests.rollout.conftest import make_engine, start_fake_servers
    from tests.rollout.fake_server import CORRUPTIONS
    from tests.rollout.helpers import expected_tokens

    prompt, faults = [101, 102, 103], ["500", "malformed", "bad_shape", *CORRUPTIONS]
    (server,) = start_fake_servers(1)

    def inject(fault: str, times: int) -> None:
        body = json.dumps({"faults": [fault] * times}).encode()
        urllib.request.urlopen(urllib.request.Request(f"http://{server.address}/_faults", data=body, method="POST"))

    def sample(engine) -> list[int]:
        request = ModelRequest(input_ids=prompt, gconfig=GenerationHyperparameters(max_new_tokens=8))
        return asyncio.run(engine.agenerate(request)).output_tokens

    outcomes = []
    try:
        for fault in faults:
            engine = make_engine([server.address], request_retries=2)
            try:
                inject(fault, 1)
                outcomes.append(_survived(lambda: sample(engine) == expected_tokens(len(prompt), 8)[0]))
                inject(fault, 3)
                try:
                    sample(engine)
                    outcomes.append("silently accepted")
                except InferenceServerError as err:
                    outcomes.append("clear error" if server.address in str(err) and "3 attempts" in str(err)
                                    else "unclear error")  # fmt: skip
                except Exception:  # noqa: BLE001
                    outcomes.append("crash")
            finally:
                engine.destroy()
    finally:
        server.stop()
    return outcomes


def _recover_outcomes() -> list[str]:
    import torch

    from tests.utils.test_recover import dump, load

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
