"""Ending a rank's process once its work is done, without the interpreter's teardown.

After a rank has destroyed its process group and written every output, the interpreter's
teardown still runs the gloo backend's thread destructors, which occasionally abort the
finished process ("terminate called without an active exception", exit code -6); a launcher
such as ``torchrun`` then reports the whole job as failed. :func:`exit_without_teardown`
flushes the standard streams and ends the process with ``os._exit``.
"""
from __future__ import annotations

import os
import sys
from typing import NoReturn

__all__ = ["exit_without_teardown"]


def exit_without_teardown(code: int = 0) -> NoReturn:
    """Flush ``sys.stdout`` / ``sys.stderr`` and end the process with exit status ``code``,
    skipping ``atexit`` handlers and finalizers: call it only once the process group is
    destroyed and every file is written and closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
