"""The plan printed before submission: layout, estimates (memory, FLOPs, bubble, communication), search."""
