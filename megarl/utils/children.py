"""megarl's child processes (the trainer's torchrun, every inference server): started so that none
outlives the run, stopped with everything they started.

A :class:`Child` is a command

* run under a keeper (:mod:`megarl.utils.keeper`), in a session of its own: it ends with the process
  that started it however that one dies, SIGKILL and the OOM killer included;
* registered to be stopped when this process exits or gets SIGTERM / SIGINT
  (:func:`megarl.utils.process.kill_on_exit`);
* marked (:class:`megarl.utils.process.LaunchMark`, in its environment), so that what it leaves
  behind when it dies first (vLLM's engine core, ranks in sessions of their own) is found later.

:meth:`Child.stop` undoes all three, in that order, whether the command still runs or died already.
The launchers and the servers go through this class only; the keeper and the process-tree functions
are its parts.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

from megarl.utils import keeper
from megarl.utils.process import LaunchMark, cancel_kill_on_exit, kill_on_exit, stop_leftovers, terminate_process_tree


class Child:
    """One started command (see the module doc); ``popen_kwargs`` go to ``subprocess.Popen``.

    ``scratch``: a directory of the command's own, removed once it stopped (by its keeper, or by
    :meth:`stop` when the keeper could not).
    """

    def __init__(
        self,
        cmd: Sequence[str],
        env: dict[str, str] | None = None,
        nice: int = 0,
        scratch: str | None = None,
        **popen_kwargs,
    ):
        self.mark = LaunchMark.new()
        self.scratch = scratch
        env = {**(os.environ if env is None else env), **self.mark.env}
        self.popen = keeper.spawn(cmd, env=env, nice=nice, scratch=scratch, **popen_kwargs)
        kill_on_exit(self.popen)
        self._stopped = False

    @property
    def pid(self) -> int:
        """The keeper's pid: it leads the command's session and process group."""
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    @property
    def stdout(self):
        return self.popen.stdout

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the keeper (a crash, as tests inject it): its command gets SIGTERM and its own leftovers stay."""
        self.popen.kill()

    def command_pid(self) -> int:
        """The command's own pid, for what must reach it rather than its keeper (``SIGSTOP``, ``py-spy``)."""
        return keeper.command_pid(self.popen)

    def stop(self, timeout: float, whole_tree: bool = False) -> None:
        """Stop the command (SIGTERM, SIGKILL after ``timeout`` s), kill what it left behind and remove its
        scratch directory; idempotent.

        The keeper passes SIGTERM on to the command once and stops the rest after it exits; with
        ``whole_tree`` every process of the tree gets it at once (torchrun's ranks: each rank must see
        it, not only their agent).
        """
        if self._stopped:
            return
        self._stopped = True
        cancel_kill_on_exit(self.popen)
        if whole_tree:
            terminate_process_tree(self.popen, timeout=timeout)
        else:
            keeper.stop(self.popen, timeout)
        stop_leftovers(self.popen.pid, self.mark)
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
