"""Node health, in-run detection and log analysis."""
