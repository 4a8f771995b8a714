"""The project's Prefect flows: the entrypoints prefect.yaml deploys."""
