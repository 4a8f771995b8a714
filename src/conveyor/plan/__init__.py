"""Pure functions over a checked spec: the graph, selection, fingerprints, what is stale and why."""
