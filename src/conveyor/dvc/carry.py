"""Adopting DVC in a project conveyor already ran: what conveyor's own record (``.conveyor/locks``)
calls up to date is recorded in dvc.lock and the DVC cache as it is (``dvc commit``), so the first
run after ``dvc init`` and ``conveyor compile`` reruns nothing."""

from __future__ import annotations

from conveyor.dvc.compile import compiled_from
from conveyor.dvc.record import DvcRecord
from conveyor.plan.fingerprint import FingerprintRecord
from conveyor.spec.project import Project


def up_to_date_in_own_record(project: Project) -> list[str]:
    """Stages conveyor's own record (``.conveyor/locks``) calls up to date, in run order.

    Empty once dvc.yaml is compiled from the spec: DVC's record is the one in use then.
    """
    if compiled_from(project):
        return []
    from conveyor.plan.fingerprint import plan

    reasons = plan(project, set(project.order), FingerprintRecord(project))
    return [stage for stage in project.order if not reasons[stage]]


def carry_into_dvc_lock(project: Project, stages: list[str]) -> list[str]:
    """Record ``stages`` in dvc.lock and the DVC cache as they are (``dvc commit``), so adding
    DVC to a project does not rerun what already ran. Returns the stages recorded."""
    if not stages or not compiled_from(project):
        return []
    record = DvcRecord(project)
    with record.session():
        fresh = [stage for stage in stages if not record.recorded(stage)]
        for stage in fresh:
            record.save(stage)
    return fresh
