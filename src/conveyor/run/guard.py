"""The guard of one ``cmd`` stage: runs its commands, and takes them down with the runner.

Started by :mod:`conveyor.run.commands` as ``python -I guard.py '["cmd", ...]' '["/bin/sh", "-c"]'``
in a new session, so the guard, the shell and everything the commands start share one process
group that the runner can signal as a whole (a timeout, Ctrl-C). The guard's stdin is a
pipe whose other end only the runner holds: when the runner dies, even by kill -9, the
kernel closes it, the guard reads end-of-file and kills the whole group. Commands run one
after another, as DVC runs a list ``cmd``; the first that fails ends the stage.

Standard library only, and no import of conveyor: it starts in a few milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading


def _watch_runner() -> None:
    """Block on stdin until the runner's end closes, then kill this process group."""
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> int:
    commands = json.loads(argv[1])
    shell = json.loads(argv[2]) if len(argv) > 2 else ["/bin/sh", "-c"]
    threading.Thread(target=_watch_runner, daemon=True).start()
    for command in commands:
        code = subprocess.call([*shell, command], stdin=subprocess.DEVNULL)
        if code != 0:
            return code if code > 0 else 128 - code  # killed by signal N: 128 + N, as a shell says
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
