"""Model definitions (free of parallelism) and their parameter arithmetic."""
