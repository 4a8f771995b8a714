"""What the compute choices buy: Dask workers, xgboost.dask, torch DDP, memory caps, ingest concurrency."""
