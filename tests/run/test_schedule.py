"""The scheduling state on tiny hand-drawn DAGs: events in, the stages now ready out.

Arrows point the way data flows: ``a ──► b`` means b waits for a.
"""

from __future__ import annotations

from conveyor.run.schedule import Outcome, Schedule


def g(**ups: str) -> dict[str, frozenset[str]]:
    """A graph from ``stage="up1 up2"`` strings."""
    return {name: frozenset(u.split()) for name, u in ups.items()}


TREE = g(a="", b="a", c="a", d="b")
"""
a ──► b ──► d
└───► c
"""


def test_schedule_runs_each_stage_once_its_upstream_succeeded() -> None:
    schedule = Schedule(TREE, set(TREE))
    assert schedule.ready() == ["a"]
    assert schedule.ready() == []  # already started
    assert schedule.running == {"a"}
    assert schedule.finish("a", Outcome.SUCCEEDED) == []
    assert schedule.ready() == ["b", "c"]
    schedule.finish("c", Outcome.SUCCEEDED)
    assert schedule.ready() == []
    schedule.finish("b", Outcome.SUCCEEDED)
    assert schedule.ready() == ["d"]
    assert set(schedule.order) - set(schedule.outcomes) == {"d"}
    schedule.finish("d", Outcome.SUCCEEDED)
    assert schedule.finished and schedule.running == set()


def test_a_failure_stops_exactly_its_downstream_and_the_other_branch_goes_on() -> None:
    """
    a ──► b ──► d        b fails while c runs: d is not run, c finishes
    └───► c
    """
    schedule = Schedule(TREE, set(TREE))
    schedule.ready()
    schedule.finish("a", Outcome.SUCCEEDED)
    assert schedule.ready() == ["b", "c"]
    assert schedule.finish("b", Outcome.FAILED) == ["d"]
    assert schedule.outcomes == {"a": Outcome.SUCCEEDED, "b": Outcome.FAILED, "d": Outcome.NOT_RUN}
    assert schedule.running == {"c"}
    assert schedule.ready() == []
    assert not schedule.finished
    schedule.finish("c", Outcome.SUCCEEDED)
    assert schedule.finished


def test_a_failure_leaves_an_independent_branch_runnable() -> None:
    """
    a ──► b ──► d        a fails: b, c, d not run; x ──► y still run
    └───► c ──┘
    x ──► y
    """
    graph = g(a="", b="a", c="a", d="b c", x="", y="x")
    schedule = Schedule(graph, set(graph))
    assert schedule.ready() == ["a", "x"]
    assert schedule.finish("a", Outcome.FAILED) == ["b", "c", "d"]
    schedule.finish("x", Outcome.SUCCEEDED)
    assert schedule.ready() == ["y"]
    schedule.finish("y", Outcome.SUCCEEDED)
    assert schedule.finished
    assert {n for n, o in schedule.outcomes.items() if o is Outcome.NOT_RUN} == {"b", "c", "d"}


def test_a_join_waits_for_every_branch_and_is_lost_when_one_fails() -> None:
    """
    a ──► b ──► d        c fails after b succeeded: d is not run
    └───► c ──┘
    """
    graph = g(a="", b="a", c="a", d="b c")
    schedule = Schedule(graph, set(graph))
    schedule.ready()
    schedule.finish("a", Outcome.SUCCEEDED)
    schedule.ready()
    schedule.finish("b", Outcome.SUCCEEDED)
    assert schedule.ready() == []
    assert schedule.finish("c", Outcome.FAILED) == ["d"]
    assert schedule.finished


def test_skipped_counts_as_success() -> None:
    """
    a ──► b ──► d        a and b are up to date
    └───► c
    """
    schedule = Schedule(TREE, set(TREE))
    schedule.ready()
    assert schedule.finish("a", Outcome.SKIPPED) == []
    assert schedule.ready() == ["b", "c"]
    schedule.finish("b", Outcome.SKIPPED)
    assert schedule.ready() == ["d"]


def test_stages_outside_the_selection_count_as_satisfied() -> None:
    """
    (a) ──► b ──► d        only b and d are selected: b is ready at once
    (a) ──► (c)
    """
    schedule = Schedule(TREE, {"b", "d"})
    assert schedule.order == ["b", "d"]
    assert schedule.ready() == ["b"]
    schedule.finish("b", Outcome.SUCCEEDED)
    assert schedule.ready() == ["d"]
    schedule.finish("d", Outcome.SUCCEEDED)
    assert schedule.finished


def test_schedule_keeps_the_given_order() -> None:
    """
    a    b    c        given order c, b, a
    """
    graph = g(a="", b="", c="")
    assert Schedule(graph, set(graph), order=["c", "b", "a"]).ready() == ["c", "b", "a"]




def test_a_pool_runs_at_most_its_limit_at_once_and_others_are_not_held_back() -> None:
    """
    a ──► b1, b2, b3 (local, 2 at a time)
    └───► g          (on a profile: no limit here)
    """
    graph = g(a="", b1="a", b2="a", b3="a", g="a")
    schedule = Schedule(graph, set(graph), pool_of={"a": "local", "b1": "local", "b2": "local", "b3": "local"},
                        limits={"local": 2})
    assert schedule.ready() == ["a"]
    schedule.finish("a", Outcome.SUCCEEDED)
    assert schedule.ready() == ["b1", "b2", "g"]
    assert schedule.ready() == []  # b3 waits for room
    schedule.finish("g", Outcome.SUCCEEDED)
    assert schedule.ready() == []
    schedule.finish("b1", Outcome.SKIPPED)
    assert schedule.ready() == ["b3"]
    schedule.finish("b2", Outcome.FAILED)
    schedule.finish("b3", Outcome.SUCCEEDED)
    assert schedule.finished
