"""conveyor beside `dvc repro` on the same dvc.yaml: parallel branches, sweeps, projects of thousands of stages."""
