"""What a person reads after ``conveyor run`` and from ``conveyor status``: the run's summary,
the status table, the command that resumes a run. (The live view during a run is
:mod:`conveyor.run.live`: deployment runs show it too, without the CLI.)
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from conveyor.run.live import STYLE
from conveyor.run.logs import logs_dir
from conveyor.run.record import INPUTS_CHANGED, RunRecord, record_path
from conveyor.run.session import UP_TO_DATE, RunOptions
from conveyor.spec.project import Project


def summary(record: RunRecord, project: Project, resume: str | None = None) -> RenderableType:
    """What a run did and what came out: stages, metrics, outputs, where the logs and record are."""
    title = f"{record.pipeline} · run {record.run_id} · {record.status} in {record.wall_s:.1f}s"
    table = Table()  # the title on a line of its own: a table's title wraps at the table's width
    retried = any(st.attempts > 1 for st in record.stages.values())
    for col in ("stage", "status", "duration", "profile", *(["attempts"] if retried else []), "why"):
        table.add_column(col, justify="right" if col in ("duration", "attempts") else "left")
    idle = [name for name, st in record.stages.items() if st.status == "skipped" and st.reason == UP_TO_DATE]
    folded = set(idle) if len(idle) > FOLD_IDLE else set()
    for name, st in record.stages.items():
        if name not in folded:
            table.add_row(name, Text(st.status, style=STYLE.get(st.status, "")), f"{st.duration_s:.1f}s",
                          st.where, *([str(st.attempts)] if retried else []), st.error or st.reason)
    lines: list[RenderableType] = [Text(title, style="italic", no_wrap=True, overflow="ignore")]
    if table.row_count:
        lines.append(table)
    if folded:
        lines.append(Text.assemble((f"skipped, {UP_TO_DATE}: ", STYLE["skipped"]), f"{len(idle)} stages ({idle[0]} "
                                   f"... {idle[-1]}; `conveyor status` lists each)"))
    if record.critical_path and any(st.status == "succeeded" for st in record.stages.values()):
        lines.append(Text(f"critical path: {' -> '.join(record.critical_path)} "
                          f"({record.critical_path_s:.1f}s of {record.wall_s:.1f}s wall); "
                          f"speedup {record.speedup:.2f}x (stage time {record.stage_sum_s:.1f}s)", style="dim"))
    logs = project.rel(logs_dir(project.root, record.run_id))
    for name in record.failed:
        st = record.stages[name]
        lines.append(Text(f"{name} failed: {st.error}", style="bold red"))
        if st.trace:
            lines.append(Text(st.trace, style="red"))
        lines.append(_whole("  its log: ", f"{logs}/{name}.log  (conveyor logs {name})"))
    if record.not_run:
        lines.append(Text(f"not run: {', '.join(record.not_run)}", style="yellow"))
    for name, st in record.stages.items():
        if st.inputs_changed:
            lines.append(Text(f"{name}: {'; '.join(st.inputs_changed)}: {INPUTS_CHANGED}", style="yellow"))
    lines += _metrics_lines(record, project)
    written = [out for name, st in record.stages.items() if st.status == "succeeded"
               for out in project.pipeline.stages[name].outs]
    if written:
        lines.append(Text.assemble(("outputs: ", "bold"), ", ".join(written)))
    # paths and the URL stay whole on one line, to be copied (rich would wrap them at 80 columns)
    lines.append(_whole("logs:    ", f"{logs}/  (conveyor logs STAGE)"))
    lines.append(_whole("record:  ", project.rel(record_path(project.root, record.run_id))))
    if record.flow_run_url:
        lines.append(_whole("prefect: ", record.flow_run_url))
    if record.failed:  # where a failure stands in the pipeline, what it holds up, and what else is stale
        lines.append(_whole("dag:     ", f"conveyor dag --format html{project.spec_option}  (a page: "
                                         f"{', '.join(record.failed)} failed, the stages it holds up, and why)"))
    if resume:
        lines.append(Text(f"resume with: {resume}", style="bold"))
    return Group(*lines)


def _whole(label: str, value: str) -> Text:
    return Text.assemble((label, "bold"), value, no_wrap=True, overflow="ignore")


FOLD_IDLE = 12  # more stages skipped as up to date than this: one line, not a row each
HEADLINE = 10  # numbers per metrics file in the summary; `dvc metrics show` has them all


def _metrics_lines(record: RunRecord, project: Project) -> list[RenderableType]:
    lines: list[RenderableType] = []
    for name, st in record.stages.items():
        if not st.metrics:
            continue
        shown = list(st.metrics.items())[:HEADLINE]
        more = len(st.metrics) - len(shown)
        files = ", ".join(project.metrics_of(name))
        text = "  ".join(f"{key} {value:.4g}" for key, value in shown) + (f"  (+{more} more)" if more else "")
        lines.append(Text.assemble(("metrics: ", "bold"), (f"{name} ", "cyan"), text, (f"  [{files}]", "dim")))
    return lines


LISTED = 100  # stages listed one by one by `conveyor status`; beyond, the up-to-date ones are counted


def status_table(reasons: Mapping[str, list[str]], notes: Mapping[str, list[str]] | None = None) -> RenderableType:
    """``conveyor status``: each stage, up to date or why it is stale, and what changed in its
    environment since its last run (``notes``: information, never a reason to run)."""
    table = Table(title_justify="left")
    table.add_column("stage")
    table.add_column("status")
    table.add_column("why")
    quiet = len(reasons) > LISTED  # a long pipeline: what is stale, and how many stages are not
    more = 0
    for stage, why in reasons.items():
        said = (notes or {}).get(stage, [])
        if quiet and not why and not said:
            more += 1
            continue
        state = "stale" if why else "up to date"
        text = Text("; ".join(why))
        for note in said:
            text.append(f"{'; ' if text else ''}{note}", style="cyan")
        table.add_row(stage, Text(state, style="yellow" if why else "green"), text)
    if more:
        table.add_row(f"({more:,} {'other ' if table.row_count else ''}stage{'s' if more != 1 else ''})",
                      Text("up to date", style="green"), "")
    return table


def resume_command(project: Project, run: RunRecord, options: RunOptions | None = None) -> str | None:
    """The command that re-runs what failed and everything after it (forced, if the run was)."""
    if not run.failed:
        return None
    return f"conveyor run{project.spec_option} {' '.join(run.failed)} --downstream{_carried(options)}"


def resume_interrupted(project: Project, run: RunRecord, options: RunOptions | None = None) -> str:
    """The command that finishes an interrupted run: the same selection, which skips what finished.

    A forced run is the exception: run again with ``--force`` it would redo what finished, and
    without it skip what did not (up to date before the run): so it names the stages that did not
    finish, alone (``-s``) and forced.
    """
    base = f"conveyor run{project.spec_option}"
    if options is None:
        return base
    unfinished = [name for name, st in run.stages.items() if st.status not in ("succeeded", "skipped")]
    if options.force and unfinished and len(unfinished) < len(run.stages):
        return f"{base} {' '.join(unfinished)} -s{_carried(options)}"
    named = "".join(f" {name}" for name in options.stages)
    selection = (" --downstream" if options.downstream else " -s" if options.single else " -p" if options.pipeline
                 else " -P" if options.all_pipelines else "")
    return f"{base}{named}{selection}{_carried(options)}"


def _carried(options: RunOptions | None) -> str:
    """What a resumed run must repeat of the options: ``--force``, ``--profile`` swaps, DVC's
    ``--no-commit``, ``--allow-missing`` and ``--pull`` (``-S`` is in the params file already)."""
    if options is None:
        return ""
    swaps = "".join(f" --profile {name}={target}" for name, target in options.profiles.items())
    flags = [flag for flag, given in (("--force", options.force), ("--no-commit", options.no_commit),
                                      ("--allow-missing", options.allow_missing), ("--pull", options.pull)) if given]
    return swaps + "".join(f" {flag}" for flag in flags)
