"""Prefect homes for the tests, each with a database migrated once per test run.

A Prefect server's first start on a new ``PREFECT_HOME`` migrates its SQLite database: 6 of the
10 CPU-seconds that start takes. The suite starts a server in each test process, and its tests
start many more (conveyor's own, where a test takes ``PREFECT_API_URL`` away, each on a home of
the test's own): :func:`new_home` gives each such home a copy of the one database that
:func:`migrate_template` migrated as the test run began (``tests/conftest.py``). A test of what
happens while a new database is migrated makes its home without :func:`new_home`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# the migrated database, in the environment of the test run's processes (xdist's inherit it)
TEMPLATE = "CONVEYOR_TESTS_PREFECT_DB"
# Run in the background by the test run's first process, holding the lock it was handed (file
# descriptor argv[2]) until it exits: the migration, then "ready" or "failed" with what it printed.
_MIGRATE = """
import pathlib, subprocess, sys
home = pathlib.Path(sys.argv[1])
done = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                      capture_output=True, text=True, timeout=300)
ok = done.returncode == 0 and (home / "prefect.db").is_file()
(home / ("ready" if ok else "failed")).write_text(done.stdout + done.stderr)
"""


def migrate_template() -> tuple[Path, subprocess.Popen[bytes]] | None:
    """Start migrating a new database in a folder of its own, named in ``TEMPLATE``, in the
    background: the test processes start and collect meanwhile, and :func:`new_home` waits for it
    (a test run that starts no Prefect server never does). The folder and the migrating process,
    for the caller to end and remove at the end of the run; None where the environment already
    names a database."""
    if os.environ.get(TEMPLATE):
        return None
    home = Path(tempfile.mkdtemp(prefix="conveyor-tests-prefect-db-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_SERVER_DATABASE"))}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    lock = os.open(home / "migrating.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # taken before any test process can ask: held by the child until it exits
        proc = subprocess.Popen([sys.executable, "-c", _MIGRATE, str(home)], env=env, pass_fds=(lock,),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        os.close(lock)
    # reaped as soon as it exits, not only as the run ends (tests/conftest.py): no zombie under the run's first process
    threading.Thread(target=proc.wait, name="migration-reaper", daemon=True).start()
    os.environ[TEMPLATE] = str(home / "prefect.db")
    return home, proc


def new_home(path: Path) -> Path:
    """``path`` (made if missing) as a PREFECT_HOME whose database is already migrated."""
    path.mkdir(parents=True, exist_ok=True)
    template = os.environ.get(TEMPLATE)
    if template and not (path / "prefect.db").exists():
        shutil.copyfile(_migrated(Path(template)), path / "prefect.db")
    return path


def _migrated(template: Path) -> Path:
    """``template`` once its migration has ended (a shared lock: granted when the migrating
    process exits); an error saying why if it failed."""
    home = template.parent
    if not (home / "ready").exists():
        with (home / "migrating.lock").open("rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
    if not (home / "ready").exists():
        said = (home / "failed").read_text() if (home / "failed").exists() else "it ended without a word"
        raise RuntimeError(f"could not migrate a Prefect database for the tests: {said}")
    return template
