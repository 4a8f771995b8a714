"""The end-to-end fixtures live in tests/projects.py, shared with tests/faults and tests/security."""

from projects import REPO, Project, linear_project, make_project, reference_project

__all__ = ["REPO", "Project", "linear_project", "make_project", "reference_project"]
