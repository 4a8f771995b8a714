"""Prefect homes for the tests, each with a database migrated once per test run.

A Prefect server's first start on a new ``PREFECT_HOME`` migrates its SQLite database: 6 of the
10 CPU-seconds that start takes. The suite starts a server in each test process, and its tests
start many more (conveyor's own, where a test takes ``PREFECT_API_URL`` away, each on a home of
the test's own): :func:`new_home` gives each such home a copy of the one database that
:func:`migrate_template` migrated as the test run began (``tests/conftest.py``). A test of what
happens while a new database is migrated makes its home without :func:`new_home`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# the migrated database, in the environment of the test run's processes (xdist's inherit it)
TEMPLATE = "CONVEYOR_TESTS_PREFECT_DB"


def migrate_template() -> Path | None:
    """Migrate a new database in a folder of its own, named in ``TEMPLATE``; the folder, for the
    caller to remove at the end of the run, or None where the environment already names one."""
    if os.environ.get(TEMPLATE):
        return None
    home = Path(tempfile.mkdtemp(prefix="conveyor-tests-prefect-db-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_SERVER_DATABASE"))}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    done = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                          env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or not (home / "prefect.db").is_file():
        shutil.rmtree(home, ignore_errors=True)
        raise RuntimeError(f"could not migrate a Prefect database for the tests:\n{done.stdout}{done.stderr}")
    os.environ[TEMPLATE] = str(home / "prefect.db")
    return home


def new_home(path: Path) -> Path:
    """``path`` (made if missing) as a PREFECT_HOME whose database is already migrated."""
    path.mkdir(parents=True, exist_ok=True)
    template = os.environ.get(TEMPLATE)
    if template and not (path / "prefect.db").exists():
        shutil.copyfile(template, path / "prefect.db")
    return path
