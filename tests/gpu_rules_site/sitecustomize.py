"""GPU-rules mode in every Python process started with this directory on PYTHONPATH (tests/gpu_rules.py)."""

import os

if os.environ.get("HPCTRAIN_GPU_RULES") == "1":
    from tests.gpu_rules import install_on_import

    install_on_import()
