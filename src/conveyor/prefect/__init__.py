"""The Prefect door: the flow that wraps the scheduling loop, deployments, retraining."""
