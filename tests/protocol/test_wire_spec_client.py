"""An independent client built from WIRE.md alone: the worked example of section 11
(constants, CURVE key derivation and handshake as the spec states them) is cut out of
the spec and run, as its own process, against a live endpoint."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshfl.protocol.endpoint import Endpoint, EndpointSettings
from meshfl.protocol.identity import Identity
from meshfl.protocol.ports import free_ports

SPEC = Path(__file__).resolve().parents[2] / "protocol" / "WIRE.md"
MESH = hashlib.sha256(b"spec client mesh").digest()[:16]


def spec_client() -> str:
    """The Python block of WIRE.md section 11."""
    section = SPEC.read_text().split("## 11. Worked example", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


@pytest.fixture
def alpha():
    node = Endpoint(
        Identity.generate(), MESH, EndpointSettings("alpha", f"tcp://127.0.0.1:{free_ports(1)[0]}")
    )
    node.start()
    yield node
    node.close()


def run_client(tmp_path: Path, node_contact: str, mesh_id: bytes) -> subprocess.CompletedProcess:
    script = tmp_path / "hello.py"
    script.write_text(spec_client())
    return subprocess.run(
        [sys.executable, str(script), node_contact, mesh_id.hex()],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_the_spec_client_says_hello_over_curve_and_verifies_the_answer(alpha, tmp_path):
    done = run_client(tmp_path, alpha.contact, MESH)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"peers from node {alpha.id}:"
    assert f"  alpha at {alpha.settings.listen}, id {alpha.id}" in done.stdout
    assert any(entry.name == "probe" for entry in alpha.peers())


@pytest.mark.slow
def test_the_spec_client_with_another_key_gets_no_handshake_and_no_answer(alpha, tmp_path):
    stranger = Identity.generate().public_key
    done = run_client(tmp_path, f"{stranger.hex()}@{alpha.settings.listen}", MESH)
    assert done.returncode == 1 and "no answer in 5 s" in done.stderr
    assert alpha.peers() == [] and alpha.rejections() == {}, "nothing was decoded"
    assert alpha.transport.failed_handshakes["incoming"] >= 1
