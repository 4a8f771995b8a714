"""The project's modules travel by value in what Dask pickles (conveyor.run.shipping), in a process
of its own per test: shipping changes how the whole process pickles."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SHIP = """
import pickle, sys
from pathlib import Path
from conveyor.run.shipping import project_names, ship_project_code
root = Path(sys.argv[1])
sys.path[:0] = [str(root), str(root / "src"), str(root / ".venv/lib/python3.11/site-packages")]
import distributed.protocol.pickle as dask_pickle
import numpy as np

plain = dask_pickle.dumps({"rows": list(range(5)), "text": "tasks are listed"})
ship_project_code(root)
print("names", sorted(project_names()))
import tasks.helpers, mylib
assert dask_pickle.dumps({"rows": list(range(5)), "text": "tasks are listed"}) == plain  # data: as before
buffers = []
array = dask_pickle.dumps(np.arange(1000), buffer_callback=buffers.append)
assert len(buffers) == 1 and len(array) < 1000  # out of band, as Dask sends arrays
graph = dask_pickle.dumps({"graph": [(tasks.helpers.tag, "x")], "lib": mylib.double})
sys.stdout.write("graph " + graph.hex() + "\\n")
import tasks.locked  # its function holds a lock: not picklable by value, so sent by reference, as before
assert pickle.loads(dask_pickle.dumps(tasks.locked.guarded)) is tasks.locked.guarded
"""

LOAD = """
import pickle, sys
loaded = pickle.loads(bytes.fromhex(sys.argv[1]))
fn, arg = loaded["graph"][0]
print(fn(arg), loaded["lib"](21), "tasks" in sys.modules, "mylib" in sys.modules)
"""


def test_project_modules_travel_by_value_and_data_does_not_change(tmp_path: Path) -> None:
    root = tmp_path / "project"
    for rel, text in {"tasks/__init__.py": "", "tasks/helpers.py": "def tag(x):\n    return f'mine:{x}'\n",
                      "tasks/locked.py": "import threading\nLOCK = threading.Lock()\n\n\ndef guarded():\n"
                                         "    with LOCK:\n        return 1\n",
                      "src/mylib.py": "def double(x):\n    return 2 * x\n",
                      "conveyor/__init__.py": "",  # the repository itself as a project: conveyor stays by reference
                      ".venv/lib/python3.11/site-packages/installed/__init__.py": ""}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    shipped = subprocess.run([sys.executable, "-c", SHIP, str(root)], capture_output=True, text=True, timeout=120,
                             cwd=tmp_path)
    assert shipped.returncode == 0, shipped.stderr
    lines = dict(line.split(" ", 1) for line in shipped.stdout.splitlines())
    assert lines["names"] == "['mylib', 'tasks']"

    loaded = subprocess.run([sys.executable, "-c", LOAD, lines["graph"]], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)  # no project on this side
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["mine:x", "42", "False", "False"]
