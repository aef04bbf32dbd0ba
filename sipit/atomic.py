"""Files written whole or not at all: the one place for the temp-file-and-rename pattern.

The cache files (sipit.cache), the margin store, the noise study's progress and result files and the
search's trial files go through :func:`replace_atomically`: the content is written to a temporary file
in the same directory and moved over the target with ``os.replace``, which is atomic on POSIX and
Windows. An interruption leaves the old file or the new one, never half of one, and the temporary
file is removed. A folder built whole (the dequantised GGUF cache) is staged in :func:`staging_dir`
and renamed into place the same way. Temporary names are ``.partial-<pid>-*``: what a process killed
outright (SIGKILL) leaves behind, the next writer removes (sipit.cache.remove_stale_partials).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


PARTIAL_PREFIX = ".partial-"


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _open_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file: 0666 less the process umask."""
    return 0o666 & ~_umask()


def partial_prefix() -> str:
    """The name prefix of this process's temporary files and folders: ``.partial-<pid>-``."""
    return f"{PARTIAL_PREFIX}{os.getpid()}-"


def staging_dir(parent: Path) -> Path:
    """A fresh temporary folder in ``parent`` with ``mkdir``'s mode (0777 less the umask), not ``mkdtemp``'s
    0700, to fill and then rename into place with ``os.replace``."""
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=parent, prefix=partial_prefix()))
    path.chmod(0o777 & ~_umask())
    return path


def replace_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a fresh temporary file beside ``path``, then rename it to ``path``.

    The file gets ``open()``'s mode, not ``mkstemp``'s 0600. Any error (or KeyboardInterrupt)
    removes the temporary file and propagates; ``path`` keeps its previous content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=partial_prefix(), suffix=path.suffix)
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
