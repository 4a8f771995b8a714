"""Training on a Dask cluster: torch DDP with one rank per worker, xgboost.dask, deterministic seeds."""
