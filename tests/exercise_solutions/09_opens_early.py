"""Planted bug: barrier k waits for (k - 1) * nt + 1 arrivals: the second thread to arrive waits
for nobody."""
from numba import njit

from stages.kernels.sync import ARRIVALS, atomic_add, atomic_load, cpu_relax


@njit(cache=True)
def barrier(sync, nt, k):
    atomic_add(sync, ARRIVALS, 1)
    while atomic_load(sync, ARRIVALS) < (k - 1) * nt + 1:
        cpu_relax()
    return True
