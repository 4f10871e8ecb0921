"""Goodput at scale: analytic checkpoint/failure model and a Monte-Carlo simulator (see docs/goodput.md)."""
