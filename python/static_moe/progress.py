"""Progress bars and logging for long loads and conversions, the way transformers shows them: a tqdm bar on
stderr, and records on ``logging.getLogger("static_moe")`` (silent until the application configures logging,
e.g. ``logging.basicConfig(level=logging.INFO)``).

``progress_bar(total=..., desc=..., enable=None)``: ``enable`` True / False forces the bar on / off; None shows it
when stderr is a terminal and the work is large (``total`` ≥ 256 MiB), unless ``STATIC_MOE_PROGRESS`` is set
(``1`` on, ``0`` off). Without a bar the returned object takes the same calls and does nothing.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("static_moe")

LARGE_BYTES = 256 << 20


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_enabled(total: int, enable: bool | None = None) -> bool:
    """Whether a bar is shown for ``total`` bytes of work (see the module doc)."""
    if enable is not None:
        return bool(enable)
    env = os.environ.get("STATIC_MOE_PROGRESS", "")
    if env in ("0", "1"):
        return env == "1"
    return total >= LARGE_BYTES and sys.stderr is not None and sys.stderr.isatty()


def progress_bar(*, total: int, desc: str, enable: bool | None = None):
    """A tqdm bar counting ``total`` bytes (tqdm is a transformers dependency, and this package's), or a no-op."""
    if not progress_enabled(total, enable):
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)
