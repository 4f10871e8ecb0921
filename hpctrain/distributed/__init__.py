"""Task-side environment: ranks, rendezvous, environment variables, process group."""
