"""The DVC door: dvc.yaml compiled from the spec, and dvc.lock as the shared record."""
