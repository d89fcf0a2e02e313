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
"""

from __future__ import annotations

import fcntl
import itertools
import os


def lock_saves():
    """Replace numba's cache save (numba.core.caching.IndexDataCacheFile.save) by one that
    holds the index's lock and writes the data first. Idempotent."""
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
    cls.save = save
