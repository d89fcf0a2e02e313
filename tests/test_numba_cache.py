"""app/numba_cache.py: processes saving into one numba cache at once. Each entry survives the
other's save, and an entry never points at a data file not yet written. Each check also runs
against numba's own save (a process that skips app.configure_numba), which fails it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# argv: cache folder, locked|bare (app.configure_numba or numba's own save), key, then what to
# plant: "dawdle" (after reading the index, say "read" and wait for a line on stdin before writing
# it back), "contend" (say "waits" when the index's lock is held by another process, just before
# waiting for it; "saved" once the save is done), "check-order" (at the moment the index is
# written, the entry's data file must exist).
SAVER = """
import fcntl, os, sys
folder, mode, key, plant = sys.argv[1:5]
if mode == "locked":
    import app
    app.configure_numba()
from numba.core.caching import IndexDataCacheFile
f = IndexDataCacheFile(folder, "kernel", "stamp")
if plant == "dawdle":
    read = f._load_index
    def dawdle():
        got = read()
        print("read", flush=True)
        sys.stdin.readline()            # the other saver has saved, or waits for this one's lock
        return got
    f._load_index = dawdle
elif plant == "contend":
    flock = fcntl.flock
    def contended(fd, op):
        if op == fcntl.LOCK_EX:
            try:
                return flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:     # another process holds it: say so, then wait for it
                print("waits", flush=True)
        return flock(fd, op)
    fcntl.flock = contended
elif plant == "check-order":
    write = f._save_index
    def checked(overloads):
        assert os.path.exists(f._data_path(overloads[key])), "the entry was written before its data"
        write(overloads)
    f._save_index = checked
f.save(key, key * 1000)
print("saved", flush=True)
"""


def save(folder, mode, key, plant="") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SAVER, str(folder), mode, key, plant or "-"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def entries(folder) -> dict:
    from numba.core.caching import IndexDataCacheFile
    f = IndexDataCacheFile(str(folder), "kernel", "stamp")
    return {key: f.load(key) for key in ("A", "B")}


def two_at_once(folder, mode) -> dict:
    """A reads the index and waits; B saves meanwhile (numba's own save: it saves; the locked
    save: it waits for A's lock, which B says before it waits); then A writes. Ordered by what
    each process says, never by a clock."""
    folder.mkdir()
    a = save(folder, mode, "A", "dawdle")
    assert a.stdout.readline().strip() == "read", a.stderr.read()
    b = save(folder, mode, "B", "contend")
    said = b.stdout.readline().strip()
    assert said == ("waits" if mode == "locked" else "saved"), (said, b.stderr.read())
    a.stdin.write("go\n")
    a.stdin.flush()
    for p in (b, a):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    return entries(folder)


def test_two_processes_saving_at_once_keep_both_entries(tmp_path):
    assert two_at_once(tmp_path / "locked", "locked") == {"A": "A" * 1000, "B": "B" * 1000}
    bare = two_at_once(tmp_path / "bare", "bare")                   # numba's own save: B's entry is lost
    assert bare["B"] is None and bare["A"] == "A" * 1000, bare


@pytest.mark.parametrize("mode", ["locked", "bare"])
def test_an_entry_is_written_after_its_data(tmp_path, mode):
    p = save(tmp_path, mode, "A", "check-order")
    out, err = p.communicate(timeout=120)
    if mode == "locked":
        assert p.returncode == 0, err[-2000:]
        assert entries(tmp_path)["A"] == "A" * 1000
    else:                                                             # numba's own order: index first
        assert p.returncode != 0 and "the entry was written before its data" in err, err[-2000:]


# ---- the numba it was written against ------------------------------------------------------------

def test_the_installed_numba_is_one_the_lock_was_checked_against():
    """The save replaced and the methods it calls are numba's private code: a numba outside
    NUMBA_VERSIONS, or whose methods differ from PRIVATE_API's fingerprints, fails here by name."""
    import numba
    from numba.core.caching import IndexDataCacheFile

    from app.numba_cache import unverified
    assert unverified(numba.__version__, IndexDataCacheFile) == []


def test_requirements_pin_numba_to_the_checked_releases():
    from app.numba_cache import NUMBA_VERSIONS
    pins = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
            if line.startswith("numba")]
    assert pins == [NUMBA_VERSIONS], f"requirements.txt pins {pins}; app/numba_cache.py was checked against " \
                                     f"{NUMBA_VERSIONS}"


def test_an_unknown_numba_is_named():
    """Planted: a release past the range, one before it, a method whose source changed and one gone."""
    from numba.core.caching import IndexDataCacheFile

    from app.numba_cache import unverified
    assert "outside numba>=0.60,<0.69" in unverified("0.69.0", IndexDataCacheFile)[0]
    assert "outside" in unverified("0.59.1", IndexDataCacheFile)[0]
    assert unverified("0.68.1", IndexDataCacheFile) == unverified("0.60.0", IndexDataCacheFile) == []

    class Changed(IndexDataCacheFile):
        def _save_index(self, overloads):            # a release that writes the index another way
            pass
    assert [p.split(" changed")[0] for p in unverified("0.68.1", Changed)] == ["IndexDataCacheFile._save_index"]

    class Gone(IndexDataCacheFile):
        _data_name = None
    assert unverified("0.68.1", Gone) == ["IndexDataCacheFile._data_name is gone: read numba's new caching.py "
                                          "before moving the pin"]


# argv: cache folder, locked|bare, then "save" (an entry whose key holds an instance of a class in
# the module `ghost`, importable from the folder) or "load" (with the module gone: the entry)
GHOST = """
import sys
folder, mode, what = sys.argv[1:4]
if mode == "locked":
    import app
    app.configure_numba()
from numba.core.caching import IndexDataCacheFile
f = IndexDataCacheFile(folder, "kernel", "stamp")
if what == "save":
    sys.path.insert(0, folder)
    import ghost
    f.save(("B", ghost.Ghost(1)), "b")
    f.save("A", "a")
    print(f.load("A"))
else:
    print(f.load("A"))
"""


@pytest.mark.parametrize("mode", ["locked", "bare"])
def test_an_index_naming_a_module_gone_is_a_miss_not_a_crash(tmp_path, mode):
    """An index whose keys name a type from a module no later process can import (a learner's
    solution loaded under a made-up name): loading any entry of it is a miss, recompiled, where
    numba's own load raises (planted: the bare save and load, mode "bare")."""
    (tmp_path / "ghost.py").write_text("from collections import namedtuple\nGhost = namedtuple('Ghost', 'x')\n")
    run = lambda what: subprocess.run([sys.executable, "-c", GHOST, str(tmp_path), mode, what], cwd=ROOT,
                                      capture_output=True, text=True, timeout=120)
    saved = run("save")
    assert saved.returncode == 0 and saved.stdout.strip() == "a", saved.stderr[-2000:]
    (tmp_path / "ghost.py").unlink()
    loaded = run("load")
    if mode == "locked":
        assert loaded.returncode == 0 and loaded.stdout.strip() == "None", loaded.stderr[-2000:]
    else:
        assert loaded.returncode != 0 and "No module named 'ghost'" in loaded.stderr
