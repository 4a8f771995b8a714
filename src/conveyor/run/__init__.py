"""Running stages: the scheduling state, the stage runner, atomic outs, profiles, commands."""
