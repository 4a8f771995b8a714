"""Fault tests run real projects as end-to-end tests do (tests/projects.py)."""

from projects import Project, make_project, reference_project

__all__ = ["Project", "make_project", "reference_project"]
