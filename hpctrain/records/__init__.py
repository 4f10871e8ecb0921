"""What a run leaves on disk, in one place: the names of its files and the records both sides read.

The task side (training, health checks, tracking) writes these records and the login side (launcher,
supervisor, checkpoint tools) reads them; both import this package, never each other.
"""
