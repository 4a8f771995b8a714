"""DVC's errors about a dvc.yaml (its schema, YAML syntax, interpolation) as conveyor's issues:
file, line, key, and what DVC said."""

from __future__ import annotations

import re
from pathlib import Path

from conveyor.errors import SpecIssue
from conveyor.spec.yamlmap import LoadedYaml

_RESOLVE = re.compile(r"failed to parse '([^']*)' in '[^']*':\s*(.*)", re.DOTALL)


def dvc_issues(dvc_file: Path, written: LoadedYaml, exc: Exception) -> list[SpecIssue]:
    """DVC's error about ``dvc_file`` as conveyor issues: file, line, key, what DVC said."""
    cause = getattr(exc, "exc", None)
    errors = getattr(cause, "errors", None)
    if errors:  # schema: voluptuous errors, each with its key path
        issues = []
        for error in errors:
            key = tuple(error.path)
            what = "unknown key" if error.msg == "extra keys not allowed" else error.msg
            hint = f" '{key[-1]}'" if what == "unknown key" and key else ""
            issues.append(SpecIssue(dvc_file, written.line(key), ".".join(map(str, key)),
                                    f"{what}{hint} (DVC's schema of dvc.yaml)"))
        return issues
    syntax = exc.__cause__  # YAML syntax: DVC's error wraps ruamel's, which has the line
    mark = getattr(syntax, "problem_mark", None)
    if mark is not None:
        problem = getattr(syntax, "problem", None) or "not valid YAML"
        return [SpecIssue(dvc_file, mark.line + 1, "", f"not valid YAML: {problem}")]
    text = str(exc).strip()
    found = _RESOLVE.match(text)
    if found:  # interpolation: "failed to parse 'stages.a.cmd' in 'dvc.yaml': Could not find 'x'"
        key = tuple(found.group(1).split("."))
        return [SpecIssue(dvc_file, written.line(key), found.group(1), found.group(2).strip())]
    return [SpecIssue(dvc_file, None, "", text)]
