"""llama.cpp's own command-line tools, built once from the sources inside llama-cpp-python's
sdist on PyPI (the same llama.cpp as the baseline): `llama-server` for the load test,
`llama-quantize` to make the comparison's models the way a llama.cpp user makes them.

    tool("llama-quantize")      the binary's path, building it first if need be (several minutes)
    server_binary(choice)       a benchmark's --llama-server (auto, a path, or None)
    quantized(src, "Q4_K_M")    `llama-quantize --allow-requantize src ... Q4_K_M`, once, into
                                models/quantized/ (every tensor dequantized, then quantized by
                                llama.cpp's own recipe: Q6_K for the output and some attn_v and
                                ffn_down, Q4_K elsewhere)
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from app.models import LLAMA_CPP_SDIST, MODELS_DIR, fetch_pypi_dist
from common.generate import ParameterError

LLAMA_DIR = MODELS_DIR / "llama-server"          # sources and build (named for its first tool)
QUANTIZED_DIR = MODELS_DIR / "quantized"


def sources() -> Path:
    """llama.cpp's source tree, unpacked from the sdist once."""
    src = LLAMA_DIR / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    LLAMA_DIR.mkdir(parents=True, exist_ok=True)
    sdist = fetch_pypi_dist(LLAMA_CPP_SDIST, LLAMA_DIR)
    found = False
    with tarfile.open(sdist) as t:
        for m in t.getmembers():
            parts = m.name.split("/")
            if len(parts) > 3 and parts[1:3] == ["vendor", "llama.cpp"] and (m.isfile() or m.isdir()):
                found = True
                m.name = "/".join(parts[3:])
                t.extract(m, src, filter="data") if hasattr(tarfile, "data_filter") else t.extract(m, src)
    if not found:
        raise SystemExit(f"{sdist.name} has no vendor/llama.cpp")
    return src


def tool(name: str) -> Path:
    """The path of llama.cpp's tool `name` (llama-server, llama-quantize, ...), built if missing."""
    build = LLAMA_DIR / "build"
    binary = build / "bin" / name
    if binary.exists():
        return binary
    src = sources()
    flags = ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release"]
    if platform.machine() == "x86_64":         # as the Makefile's llama-cpp target: no AMX tiles
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        flags += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    print(f"building {name} in {build} (several minutes)...", file=sys.stderr)
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), *flags], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", name, "-j", str(os.cpu_count() or 2)], check=True)
    if not binary.exists():
        raise SystemExit(f"the build ended without {binary}")
    return binary


def server_binary(choice: str | None) -> Path | None:
    """A benchmark's --llama-server: 'auto' builds llama-server once (tool), a path or a name on PATH
    must be there (ParameterError), None is none."""
    if choice is None:
        return None
    if choice == "auto":
        return tool("llama-server")
    path = Path(shutil.which(choice) or choice)
    if not path.exists():
        raise ParameterError(f"no llama-server at {path}")
    return path


def quantized(src: Path, recipe: str = "Q4_K_M") -> Path:
    """src requantized by llama-quantize with `recipe`, once: models/quantized/<stem>.<recipe>.gguf."""
    src = Path(src)
    stem, _, last = src.stem.rpartition(".")
    stem = stem if last[:1] in ("Q", "F", "B") and stem else src.stem      # drop the file's own type
    out = QUANTIZED_DIR / f"{stem}.llama-quantize-{recipe}.gguf"
    if out.exists():
        return out
    QUANTIZED_DIR.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    subprocess.run([str(tool("llama-quantize")), "--allow-requantize", str(src), str(part), recipe], check=True,
                   stdout=subprocess.DEVNULL)
    os.replace(part, out)
    return out
