"""What the warm runner makes once, on Prefect's side, for every run it forks (conveyor.cli.warm_runner).

- The TLS context of Prefect's clients (:mod:`conveyor.prefect.tls`).
- The validators of Prefect's models. Prefect defines its client's models with forward references
  that resolve only once the modules they name are loaded, so pydantic puts off building their
  validators to their first use; in a forked run that first use came in every run (the flow run
  Prefect creates and reads, its artifacts, logs and events: 10 to 15 ms of a forced two-stage
  run's 0.4 CPU-s, measured interleaved). :func:`complete_models` builds them in the runner once
  (the 258 that Prefect 3.9's imports leave unbuilt, in 60 ms); its runs inherit them.
"""

from __future__ import annotations

import sys


def prepare() -> None:
    """The TLS context and the models, made in this process for the runs it forks."""
    from conveyor.prefect import tls

    tls.share()
    tls.context()  # made here once, for every run forked after
    complete_models()


def complete_models() -> int:
    """Build the validators that pydantic put off of the models of Prefect's loaded modules; how many."""
    from pydantic import BaseModel

    built = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "prefect" or name.startswith("prefect.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == name \
                    and not value.__pydantic_complete__:
                try:
                    value.model_rebuild()
                except Exception:  # noqa: BLE001,S112  # a name it needs is not loaded here: built at its first use
                    continue
                built += 1
    return built
