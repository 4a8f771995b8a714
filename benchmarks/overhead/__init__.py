"""What conveyor itself costs against the peers a user would use instead: no-op runs, chains, the reference pipeline."""
