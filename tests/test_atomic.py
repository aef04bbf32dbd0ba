"""sipit.atomic: a file is replaced whole or not at all, with the mode open() would give it."""

import os

import pytest
import torch

from sipit.atomic import replace_atomically, write_text_atomic
from sipit.cache import save as save_to_cache


def test_an_interrupted_write_keeps_the_old_file_and_leaves_no_partial(tmp_path):
    path = tmp_path / "sub" / "progress.json"
    write_text_atomic(path, '{"rows": [1]}')

    def half_then_interrupt(tmp):
        tmp.write_text('{"rows": [1, 2')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_atomically(path, half_then_interrupt)
    assert path.read_text() == '{"rows": [1]}'
    assert sorted(p.name for p in path.parent.iterdir()) == ["progress.json"]

    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_save_to_cache_round_trips_and_an_unwritable_cache_only_returns_false(tmp_path):
    path = tmp_path / "table.pt"
    assert save_to_cache({"x": torch.arange(3)}, path)
    assert torch.equal(torch.load(path)["x"], torch.arange(3))

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert save_to_cache({"x": 1}, not_a_dir / "table.pt") is False  # the cache cannot be written: rebuild later
