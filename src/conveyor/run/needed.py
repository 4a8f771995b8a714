"""What a stage reads from the stages it ``needs``: their outs among its deps, and the items
of a matrix stage one by one (:class:`~conveyor.run.context.MatrixItem`).

``needs: [train]`` on a matrix means every item of ``train`` (the spec expands it to the
items' names), and the compiled dvc.yaml lists their outs and metrics as the stage's deps:
the task gets the same paths, so the stage that picks the best model finds the models.
"""

from __future__ import annotations

from pathlib import Path

from conveyor.plan.fingerprint import data_deps
from conveyor.run.context import MatrixItem
from conveyor.spec.project import Project


def stage_deps(project: Project, stage: str) -> dict[str, Path]:
    """Declared path -> absolute path, for the stage's deps and the outs of what it needs."""
    return {path: project.root / path for path in data_deps(project, stage)}


def needed_items(project: Project, stage: str) -> dict[str, dict[str, MatrixItem]]:
    """Matrix stage -> its items that ``stage`` needs, by item name, in the matrix's order."""
    if project.matrix is None:
        return {}
    needs = set(project.pipeline.stages[stage].needs)
    found: dict[str, dict[str, MatrixItem]] = {}
    for group, items in project.matrix.groups.items():
        chosen = {name: _item(project, name) for name in items if name in needs}
        if chosen:
            found[group] = chosen
    return found


def _item(project: Project, name: str) -> MatrixItem:
    spec, root = project.pipeline.stages[name], project.root
    return MatrixItem(stage=name, values=project.item_of(name) or {}, outs={o: root / o for o in spec.outs},
                      metrics={m: root / m for m in spec.metrics}, names=dict(spec.names))
