"""When the trainer fails, the console shows why: the failed rank's exception, not torchrun's report of it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from megarl.launcher.local import _tail

FAILING = textwrap.dedent(  # a rank of a process group: torch prints its exception as "[rank0]: ..." lines
    """
    import torch.distributed as dist

    class ConsistencyError(RuntimeError):
        pass

    dist.init_process_group("gloo")

    for line in range(40):
        print(f"step output {line}")
    raise ConsistencyError("servers' probe logprobs differ from the trainer's by 0.23")
    """
)


def test_the_console_tail_is_the_failed_ranks_exception(tmp_path):
    script, log = tmp_path / "fail.py", tmp_path / "trainer.log"
    script.write_text(FAILING)
    with open(log, "wb") as out:  # as the launcher runs the trainer: torchrun, its ranks' output in one log
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(script)]
        assert subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=120, check=False).returncode == 1
    text = log.read_text()
    why = "ConsistencyError: servers' probe logprobs differ from the trainer's by 0.23"
    assert why in text and why not in "\n".join(text.splitlines()[-20:])  # torchrun's report ends the log
    tail = _tail(log)
    assert why in tail and "ChildFailedError" not in tail and "step output 39" not in tail, tail
    plain = tmp_path / "plain.log"
    plain.write_text("\n".join(f"line {i}" for i in range(30)))
    assert _tail(plain) == "\n".join(f"line {i}" for i in range(10, 30))  # no failure report: the last lines
