"""Stage 13, amx: the prompt on the CPU's matrix unit.

The lesson: the prefill stage showed that a prompt is bound by the core's multiply-adds, not by
memory, and took the vector unit as far as two prompt rows to a 512-bit vpdpbusd (64 int8
multiply-adds an instruction). Intel's Xeons from the 4th generation on (Sapphire Rapids) carry a
second unit for exactly that work: AMX, eight tile registers of 16 rows x 64 bytes and one
instruction, TDPBSSD, that multiplies two tiles into a third, 16 x 16 x 64 = 16,384 multiply-adds,
about 1,024 a cycle against the vector unit's 128: the CPU's tensor core.

* The weights get a second copy at load, in the tile layout (stages/kernels/amx_tiles.py draws
  it): groups of 16 rows, each block of 32 values (16 for Q6_K) as a B tile whose row k holds
  values 4k .. 4k + 3 of the 16 rows in turn, signed bytes, the block's scales beside it. The
  copy sits right after the matrix's repacked bytes, which decode keeps reading.
* The activation rows are the 8-bit packs the stages before already round them into: an A tile
  is 16 of their rows, loaded straight from the pack with its row stride.
* One tile product per block gives the exact int32 sums repack's kernel computes for 16 x 16
  (weight row, prompt row) pairs; the block's float steps then run on 512-bit vectors in repack's
  order, so a prompt row's logits are repack's bits whichever unit computed them.
* A work item of AMX_ROWS prompt rows or more goes to the unit (stages/kernels/amx_steps.py); a
  decode row, and a step of few rows, stay on the prefill stage's kernels.

The unit is there only on those Xeons, and Linux gives a process its tile registers only when it
asks (arch_prctl ARCH_REQ_XCOMP_PERM, once per process: tile_refusal below); elsewhere the stage
says which of the two is missing. What limits it: the float steps after every block (a product of
one block is 16 x 16 sums to scale, 16 vector multiply-adds for 8,192 multiply-adds of the
unit), the K-quants' sub-block scales (one tile product per 32 or 16 values), and the copy of the
weights (about a byte per weight beside repack's half-byte).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os

import numpy as np

from stages.kernels import amx_steps
from stages.kernels.amx_steps import Amx
from stages.kernels.amx_tiles import AMX_TYPES, amx_ready, tile_layout, tiled_bytes
from stages.kernels.repacked import repack, unpack
from stages.prefill import LOGIT_TOLERANCE, PrefillBackend
from stages.repack import RepackedMatrix

__all__ = ["AmxBackend", "LOGIT_TOLERANCE", "tile_refusal"]

ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1023, 18, 158     # Linux, x86-64


@functools.cache
def tile_refusal() -> str | None:
    """Ask Linux for this process's tile data (once; every thread of the process then may use the
    tiles): None where granted, else why not, in the kernel's terms (its errno)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0:
            return None
        err = ctypes.get_errno()
    except (OSError, AttributeError) as e:
        return f"the C library's syscall() could not be called ({e})"
    return REFUSALS.get(err, f"{errno.errorcode.get(err, err)}: {os.strerror(err)}")


# what the kernel's answers mean (arch/x86/kernel/fpu/xstate.c, Linux 5.16 and later)
REFUSALS = {
    errno.EOPNOTSUPP: "EOPNOTSUPP: the kernel has no tile data to give (the CPU, the hypervisor or the kernel's "
                      "configuration left AMX off)",
    errno.EINVAL: "EINVAL: this kernel does not know the request (Linux before 5.16)",
    errno.ENOSPC: "ENOSPC: a thread's alternate signal stack (sigaltstack) is smaller than a signal frame with the "
                  "tiles' 8 KiB of state; give it at least getauxval(AT_MINSIGSTKSZ) bytes",
    errno.EPERM: "EPERM: a security policy (seccomp) or a 32-bit kernel forbids it",
}


class TiledMatrix(RepackedMatrix):
    """A repacked matrix with its tile copy after it (amx_tiles.tile_layout): `data` the repacked
    bytes and then the copy (`tiles`), views into the stage's one buffer: what a kernel is given for
    the matrix reaches both."""

    def __init__(self, source, tensor):
        super().__init__(source, tensor)
        self.repacked_bytes = self.nbytes
        self.nbytes += tiled_bytes(self.shape[0], self.row_bytes, self.kind)
        self.tiles = None

    def rows(self) -> np.ndarray:
        return unpack(self.data[:self.repacked_bytes], self.kind, self.shape[0], self.row_bytes)


class AmxBackend(PrefillBackend):
    name = "amx"
    stack = amx_steps.STACK             # prefill's, with the matmuls of many rows on the matrix unit
    records = (Amx,)                    # prefill's record's fields: a type of the stage's own

    @staticmethod
    def unavailable_reason() -> str | None:
        if not amx_ready():
            return ("this CPU has no matrix unit (amx_tile and amx_int8 are not among its /proc/cpuinfo flags): "
                    "AMX is on Intel Xeons of the 4th generation (Sapphire Rapids) and later")
        refused = tile_refusal()
        if refused:
            return ("Linux did not give this process the tile registers (arch_prctl ARCH_REQ_XCOMP_PERM was "
                    f"refused, {refused}): Linux 5.16 or later enables AMX for the processes that ask")
        return PrefillBackend.unavailable_reason()

    def prepare_matrix(self, tensor):
        m = super().prepare_matrix(tensor)
        return TiledMatrix(m.source, tensor) if isinstance(m, RepackedMatrix) and m.kind in AMX_TYPES else m

    def tie_output(self, embedding, tensor):
        m = super().tie_output(embedding, tensor)
        return TiledMatrix(m.source, tensor) if isinstance(m, RepackedMatrix) and m.kind in AMX_TYPES else m

    def finish_load(self, model):
        """Every matrix rearranged into one buffer, a tiled one's copy right after its repacked bytes
        (where amx_steps.tile_copy_at looks)."""
        matrices = [w for w in model._weights() if isinstance(w, RepackedMatrix)]
        self.buffer = np.empty(sum(m.nbytes for m in matrices), np.uint8)
        o = 0
        for m in matrices:
            if isinstance(m, TiledMatrix):
                repack(m.source.data, m.kind, self.buffer[o:o + m.repacked_bytes])
                m.tiles = tile_layout(m.source.data, m.kind, self.buffer[o + m.repacked_bytes:o + m.nbytes])
                m.data = self.buffer[o:o + m.nbytes]
            else:
                m.data = repack(m.source.data, m.kind, self.buffer[o:o + m.nbytes])
            o += m.nbytes
            if m.source is not model.token_embd:
                model.gguf.release(m.tensor)
