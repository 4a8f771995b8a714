"""New git + DVC repositories for the tests: ``git init -q && dvc init -q``, made once and copied.

``dvc init`` costs a start of DVC (0.7 CPU-seconds here), and many tests make a repository of
their own. :func:`git_dvc_init` runs the commands once per test process, in a
folder of its own, and copies what they made (``.git``, ``.dvc``, ``.dvcignore``) into each new
repository: none of it names its folder, so the copy is what the commands would have made
there, files staged in git's index as ``dvc init`` leaves them. DVC's scratch folder
(``.dvc/tmp``) is not copied: DVC makes it again when it needs it, as after a user removes it.

:func:`dvc` runs the DVC commands that set a repository up or read it (``dvc status``, ``config``,
``remote``, ``add``...) and ``dvc repro`` through DVC's command line in this process
(``dvc.cli.main``), as DVC's own tests run them: each would otherwise be a start of DVC, 0.5 to
0.6 CPU-seconds (a ``dvc repro`` with nothing to do: 0.63 as a process, 0.04 here). What a
stage's command prints goes to the test's own output, not to the result (DVC's lines, the
``> command`` it runs included, are there). A ``dvc repro`` that must run beside the test
(``Popen``), ``dvc exp`` and ``push``/``pull`` stay processes of their own.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

INIT = (("git", "init", "-q"), ("dvc", "init", "-q"))
ANALYTICS_OFF = (*INIT, ("dvc", "config", "core.analytics", "false"))
_MADE: dict[tuple[tuple[str, ...], ...], Path] = {}


def git_dvc_init(root: Path, commands: tuple[tuple[str, ...], ...] = INIT) -> Path:
    """``root`` as ``commands`` (run in an empty folder) leave a new repository; returns ``root``."""
    template = _MADE.get(commands)
    if template is None:
        template = Path(tempfile.mkdtemp(prefix="conveyor-tests-repo-"))
        atexit.register(shutil.rmtree, template, True)
        for command in commands:
            done = dvc(template, *command[1:]) if command[0] == "dvc" else \
                subprocess.run(command, cwd=template, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"
        _MADE[commands] = template
    root.mkdir(parents=True, exist_ok=True)
    for entry in template.iterdir():
        if entry.is_dir():
            scratch = shutil.ignore_patterns("tmp") if entry.name == ".dvc" else None
            shutil.copytree(entry, root / entry.name, symlinks=True, ignore=scratch)
        else:
            shutil.copy2(entry, root / entry.name)
    return root



# DVC's commands that only read a repository or set it up: nothing of them outlives the call
IN_PROCESS = frozenset({"init", "status", "config", "remote", "metrics", "params", "plots", "data", "add", "checkout",
                        "repro"})


def dvc(root: Path, *argv: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``dvc ARGV`` in ``root`` with ``env`` (this process's by default): in this process for the
    commands of :data:`IN_PROCESS`, a process of its own for the others."""
    if argv and argv[0] in IN_PROCESS:
        # a copy of this process's environment: dvc_here clears os.environ before it sets the one it is given
        return dvc_here(root, list(argv), dict(os.environ) if env is None else env)
    return subprocess.run(["dvc", *argv], cwd=root, env=None if env is None else dict(env), capture_output=True,
                          text=True, timeout=300)


def dvc_here(root: Path, argv: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """``dvc ARGV`` in ``root`` with ``env``, through DVC's command line (``dvc.cli.main``) in this
    process, as DVC's own tests run it (``DVC_TEST`` set, as they set it: without it, ``--json``
    output goes through colorama's deinit, which puts back the streams colorama saw at import)."""
    from dvc.cli import main  # before the streams are redirected: DVC's log handlers keep this process's
    from dvc.logger import LoggerHandler

    out, err = io.StringIO(), io.StringIO()
    # DVC's log lines ("Running stage", its errors) go through the handlers `import dvc` made on the
    # streams of that moment: pointed at this call's for its length
    handlers = {handler: handler.stream for name in ("dvc", "dvc_objects", "dvc_data")
                for handler in logging.getLogger(name).handlers if isinstance(handler, LoggerHandler)}
    environ, cwd = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(env, DVC_TEST="true")
    try:
        os.chdir(root)
        for handler in handlers:
            handler.setStream(err if handler.level >= logging.WARNING else out)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        for handler, stream in handlers.items():
            handler.setStream(stream)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(["dvc", *argv], code, out.getvalue(), err.getvalue())
