"""Evaluate: score every model on the held-out TEST split; metrics JSON and a ROC plot.

Its deps are named (``data``, ``xgb``, ``mlp``, ``stack``); its one out is the plot and its
one metrics file the scores.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tasks import inputs, models
from tasks.files import write_json

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import pandas as pd

    from conveyor import StageContext

_DIGITS = 6


def evaluate(ctx: StageContext) -> None:
    """AUC, accuracy and log-loss of xgb, mlp and stack on test; ROC curves to a PNG."""
    processed = ctx.dep("data")
    with inputs.naming_damaged_files(ctx.stage, processed, inputs.declared(ctx, processed), writer="preprocess"):
        test = models.read_split(processed, "test")
    threshold = float(ctx.section("evaluate")["threshold"])
    probabilities = model_probabilities(test.features, ctx.dep("xgb"), ctx.dep("mlp"), ctx.dep("stack"))
    scores = {name: score(test.label, p, threshold=threshold) for name, p in probabilities.items()}
    write_json(ctx.metric(), scores)
    plot_roc(ctx.out(), test.label, probabilities)
    ctx.log.info("test AUC: %s", {name: s["auc"] for name, s in scores.items()})


def model_probabilities(
    features: pd.DataFrame, xgb_path: Path, mlp_path: Path, stack_path: Path
) -> dict[str, npt.NDArray[np.float64]]:
    """P(label = 1) of each model, keyed by the names used in metrics/test.json."""
    return models.Ensemble.load(xgb_path, mlp_path, stack_path).probabilities(features)


def score(label: npt.NDArray[np.int64], probability: npt.NDArray[np.float64], *, threshold: float) -> dict[str, float]:
    """The three test metrics of one model, rounded so that reruns compare byte for byte."""
    from sklearn.metrics import accuracy_score, log_loss, roc_auc_score

    return {
        "auc": round(float(roc_auc_score(label, probability)), _DIGITS),
        "accuracy": round(float(accuracy_score(label, probability >= threshold)), _DIGITS),
        "logloss": round(float(log_loss(label, probability, labels=[0, 1])), _DIGITS),
    }


def plot_roc(path: Path, label: npt.NDArray[np.int64], probabilities: dict[str, npt.NDArray[np.float64]]) -> None:
    """One ROC curve per model; Agg canvas on a bare Figure, so pyplot's state is untouched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from sklearn.metrics import roc_auc_score, roc_curve

    figure = Figure(figsize=(5, 5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, probability in probabilities.items():
        fpr, tpr, _ = roc_curve(label, probability)
        axes.plot(fpr, tpr, label=f"{name} (AUC {roc_auc_score(label, probability):.3f})")
    axes.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=0.8)
    axes.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC, test split")
    axes.legend(loc="lower right")
    # format given, whatever the file is called
    figure.savefig(path, format="png", metadata={"Software": None})
