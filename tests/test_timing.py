"""lowbit.toolchain.timing.last_level_cache_bytes: the size of the highest cache level in a sysfs-like tree."""

from lowbit.toolchain.timing import last_level_cache_bytes


def _cache(root, index, level, size):
    entry = root / f"index{index}"
    entry.mkdir()
    (entry / "level").write_text(f"{level}\n")
    (entry / "size").write_text(f"{size}\n")


def test_the_highest_level_is_the_last_level_cache(tmp_path):
    _cache(tmp_path, 0, 1, "48K")
    _cache(tmp_path, 1, 1, "64K")
    _cache(tmp_path, 2, 2, "2048K")
    _cache(tmp_path, 3, 3, "491520K")
    assert last_level_cache_bytes(str(tmp_path)) == 480 << 20


def test_sizes_in_other_units_and_unreadable_entries(tmp_path):
    _cache(tmp_path, 0, 2, "1M")
    _cache(tmp_path, 1, 3, "32M")
    (tmp_path / "index2").mkdir()  # no level, no size: skipped
    _cache(tmp_path, 3, 4, "garbage")  # an unreadable size: skipped, level 3 stays the last known
    assert last_level_cache_bytes(str(tmp_path)) == 32 << 20


def test_no_cache_information_gives_zero(tmp_path):
    assert last_level_cache_bytes(str(tmp_path / "missing")) == 0
