"""gpu-train: the reference training stages on the ``gpu`` profile (dask-cuda) vs in one process.

The reference tasks in a fresh process on splits by ``tasks.preprocess:prepare``, the MLP at ``EPOCHS`` epochs: no
client (XGBoost on ``ctx.devices``) vs configs/scale.yaml's gpu profile started before the clock. Needs an NVIDIA GPU
and dask-cuda. Checked: XGBoost on cuda on both sides, best valid log-losses within 2 %; the MLP trained, by NCCL there.
"""

import importlib.util
import json
from collections.abc import Callable
from functools import partial

from benchmarks.compute.torch_ddp import make_splits, measure, mlp_params, reference, side_metrics
from benchmarks.harness import Config, Result, check, interleaved, median, rows_label, scratch

NAME = "gpu-train"
DESCRIPTION = "the reference train stages on the gpu profile (dask-cuda, one worker per GPU) vs in one process"
ROWS, QUICK_ROWS, EPOCHS = 2_000_000, 200_000, 5  # the MLP trains exactly EPOCHS epochs on both sides
QUALITY = 0.02  # the XGBoost sides' best valid logloss at most this far apart, relative


def run(config: Config, log: Callable[[str], None]) -> Result:
    import torch

    check(torch.cuda.is_available(), "needs an NVIDIA GPU: torch sees none")
    check(importlib.util.find_spec("dask_cuda") is not None, "needs dask-cuda: pip install 'conveyor[gpu]'")
    rows, repeats, (mlp, seed) = QUICK_ROWS if config.quick else ROWS, config.reps(full=3, quick=1), mlp_params(EPOCHS)
    params = {"train.xgb": reference()["train"]["xgb"], "train.mlp": mlp, "seed": seed}
    with scratch(NAME) as root:
        log(f"{NAME}: generating and preprocessing {rows:,} synthetic rows (not timed)")
        splits = make_splits(root, rows, root / "processed", plain=False, per_part=125_000)
        sides = {model: partial(measure, f"train_{model}", params, root / "processed") for model in ("xgb", "mlp")}
        runs = {model: interleaved(repeats, side, partial(side, where="gpu"), log) for model, side in sides.items()}
    xgb = [done[0].report["metrics"] for done in runs["xgb"]]  # the MLP's NCCL: checked by measure
    for side, got in zip(("one-process", "gpu-profile"), xgb, strict=True):
        check(got["device"] == "cuda", f"xgb {side}: trained on {got['device']}")
    plain, profile = (got["best_valid_logloss"] for got in xgb)
    check(abs(profile - plain) <= QUALITY * plain, f"xgboost.dask's best valid logloss {profile} is more than "
                                                   f"{QUALITY:.0%} from xgb.train's {plain}")
    same = all(len({json.dumps(r.report.get("sha256", r.report["metrics"])) for r in done}) == 1
               for pair in runs.values() for done in pair)
    start = median([r.report["start"] for _, cand in runs.values() for r in cand])
    return Result(
        name=NAME, description=DESCRIPTION, repeats=repeats,
        baseline="the reference task, no cluster: XGBoost xgb.train(device='cuda'); the MLP on the CPU, every core",
        candidate="the same on the gpu profile (a LocalCUDACluster): xgboost.dask on a GPU; the MLP by DDP, NCCL",
        metrics=[m for model, label in (("xgb", "XGBoost"), ("mlp", "MLP"))
                 for m in side_metrics(f"{label} {rows_label(rows)} rows: ", *runs[model])],
        setup={"splits": str(splits), "GPU": f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"},
        notes=[f"starting the gpu profile (LocalCUDACluster, imports in its worker) took {start:.2f} s (median), "
               "outside the candidate's training wall", f"XGBoost best valid logloss: one process {plain} at iteration "
               f"{xgb[0]['best_iteration']}, gpu profile {profile} at {xgb[1]['best_iteration']}; every repetition "
               f"of each side trained the same model: {'yes' if same else 'NO'}"])
