"""The end-to-end fixtures live in tests/projects.py, shared with tests/faults and tests/security."""

from projects import Project, make_project, reference_project

__all__ = ["Project", "make_project", "reference_project"]
