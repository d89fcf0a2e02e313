"""numba's on-disk cache, made safe for processes that compile at the same time.

Many processes share one cache folder and compile at once: `make compile`'s jobs, pytest's
workers, a server under test beside its client, the MPI ranks of the tp stage. numba saves a
compiled kernel in two files: the function's index (`f.nbi`: {(signature, CPU target): data
file}) and a data file (`f.3.nbc`: the machine code). Its save reads the index, takes the first
number no entry uses, writes the index back and then the data. Two processes saving different
kernels of one function at once (another signature, or another CPU target) can both read the
same index and take the same number: the last index written loses the other's entry, and the
last data file written may be the other's code, which the index then hands out for the wrong
signature or CPU (a kernel compiled for AVX2 loaded as the AVX-512 one: other bits; for another
argument type: a crash). And between the two writes, a process loading the kernel finds an entry
whose data file is not written yet, or is an older kernel's.

So a save here holds an exclusive lock on the index (a `.lock` file beside it) from reading the
index to writing it back, and writes the data file before the entry that points at it. A load
needs no lock: both files are replaced whole (numba writes a temporary file and renames it).

And a load survives an index that names a type no process can import again (a record type defined
in a file loaded under a made-up module name, as a learner's solution is): numba's load would raise
for every entry of that function, the stage's own included; here such an index reads as empty, its
entries recompiled.

The save it replaces, and the methods the new one calls, are numba's private code: a release may
change them without a word. NUMBA_VERSIONS are the releases whose source of those methods was read
and found as PRIVATE_API fingerprints it (0.60.0 to 0.68.1, and numba's main branch of August 2026,
all the same); requirements.txt pins numba to them, and tests/test_numba_cache.py fails, saying
which method changed, on a numba outside them or whose methods differ.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import itertools
import os
import re

NUMBA_VERSIONS = "numba>=0.60,<0.69"
# sha256 (first 12 hex digits) of the source of each IndexDataCacheFile method the lock relies on:
# where the paths are set (__init__), the save replaced, what the new save calls, and the write
# through a temporary file that lets a load go without the lock (_open_for_write).
PRIVATE_API = {"__init__": "fb8a50af4936", "save": "43bf2dad8fac", "_load_index": "4fe82fb6a9f8",
               "_save_index": "3a2668b52375", "_save_data": "9034579dac9c", "_data_name": "bf680e67b1dd",
               "_data_path": "e6b6ee6fc6e7", "_open_for_write": "2a8b3105121d"}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def unverified(version: str, cls) -> list[str]:
    """What keeps numba `version` (its IndexDataCacheFile class `cls`) from being one this module
    was checked against: [] where nothing does."""
    low, high = re.fullmatch(r"numba>=([\d.]+),<([\d.]+)", NUMBA_VERSIONS).groups()
    problems = [] if _release(low) <= _release(version) < _release(high) else \
        [f"numba {version} is outside {NUMBA_VERSIONS}, the releases app/numba_cache.py was checked against"]
    for name, want in PRIVATE_API.items():
        method = getattr(cls, name, None)
        method = getattr(method, "numba_own", method)              # numba's save, where lock_saves replaced it
        got = None if method is None else hashlib.sha256(inspect.getsource(method).encode()).hexdigest()[:12]
        if got != want:
            problems.append(f"IndexDataCacheFile.{name} " + ("is gone" if got is None else f"changed ({got}, "
                            f"checked: {want})") + ": read numba's new caching.py before moving the pin")
    return problems


def lock_saves():
    """Replace numba's cache save (numba.core.caching.IndexDataCacheFile.save) by one that
    holds the index's lock and writes the data first, and its index load by one that reads an
    index it cannot unpickle as empty. Idempotent."""
    from numba.core import caching

    cls = caching.IndexDataCacheFile
    if getattr(cls.save, "locked", False):
        return

    def save(self, key, data):
        os.makedirs(self._cache_path, exist_ok=True)
        with open(self._index_path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)                # released when the file closes
            overloads = self._load_index()
            name = overloads.get(key)
            if name is None:                                # the first number no entry uses
                taken = set(overloads.values())
                name = next(n for n in map(self._data_name, itertools.count(1)) if n not in taken)
            self._save_data(name, data)                     # the code, then the entry pointing at it
            if overloads.get(key) != name:
                overloads[key] = name
                self._save_index(overloads)

    save.locked = True
    save.numba_own = cls.save
    cls.save = save

    numba_load = cls._load_index

    def _load_index(self):
        """numba's, except that an index naming a type no module defines any more reads as empty:
        every entry of it is then a miss, recompiled and saved again. (numba unpickles a whole
        index to find one entry, and a key's signature holds its argument types by their module:
        a record type of a file loaded under a name of its own, as a learner's solution is
        (exercises/harness.py), is found by no later process, and numba's load then raises for
        every entry of the function, the stage's own included.)"""
        try:
            return numba_load(self)
        except (ImportError, AttributeError):
            return {}

    _load_index.numba_own = numba_load
    cls._load_index = _load_index
