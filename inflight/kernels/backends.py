"""The kernel backends a config may name, in the order the CLI and docs list them.

A leaf (no torch): ``runtime/config.py`` validates ``kernel_backend`` against it and
``kernels/dispatch.py`` resolves it to a bundle of ops.
"""

from __future__ import annotations

KERNEL_BACKENDS = ("auto", "torch", "triton", "cpu")
