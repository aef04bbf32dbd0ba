"""Files written whole or not at all: the one place for the temp-file-and-rename pattern.

The cache files (position-0 tables, inverse heads, corpus states), the margin store, the noise
study's progress and result files and the search's trial files go through :func:`replace_atomically`: the content is written to a
temporary file in the same directory and moved over the target with ``os.replace``, which is atomic
on POSIX and Windows. An interruption leaves the old file or the new one, never half of one, and the
temporary file is removed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def _open_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file: 0666 less the process umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def replace_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a fresh temporary file beside ``path``, then rename it to ``path``.

    The file gets ``open()``'s mode, not ``mkstemp``'s 0600. Any error (or KeyboardInterrupt)
    removes the temporary file and propagates; ``path`` keeps its previous content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=".partial-", suffix=path.suffix)
    tmp = Path(name)
    try:
        os.fchmod(fd, _open_mode())
        os.close(fd)
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """``path.write_text(text)`` through :func:`replace_atomically`."""
    replace_atomically(path, lambda tmp: tmp.write_text(text))
