"""The checked-in generated code under src/tslice/api must match proto/ (run `make api`),
and must carry no runtime version gate (the job side imports it on old grpcio/protobuf)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
API_DIR = ROOT / "src" / "tslice" / "api"


def _gen_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "scripts" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_api"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)  # the first run makes the generator venv (CI makes it beforehand)
def test_generated_code_is_fresh() -> None:
    gen = _gen_module()
    with tempfile.TemporaryDirectory() as tmp:
        gen.generate(pathlib.Path(tmp))
        fresh = gen.snapshot(pathlib.Path(tmp))
    checked_in = gen.snapshot(API_DIR)
    stale = sorted(k for k in fresh if checked_in.get(k) != fresh[k])
    extra = sorted(k for k in checked_in if k not in fresh)
    assert not stale and not extra, f"stale generated files {stale + extra}: run `make api`"


@pytest.mark.parametrize(
    ("suffix", "gates"),
    [
        # protoc >= 26: refuses any protobuf runtime older than the generator
        ("_pb2.py", ("ValidateProtobufRuntimeVersion", "runtime_version")),
        # grpcio-tools >= 1.63: refuses older grpcio; older grpcio rejects _registered_method
        ("_pb2_grpc.py", ("GRPC_GENERATED_VERSION", "_registered_method")),
    ],
)
def test_generated_code_has_no_runtime_version_gate(suffix: str, gates: tuple[str, ...]) -> None:
    files = sorted(API_DIR.rglob(f"*{suffix}"))
    assert len(files) == 2
    for path in files:
        text = path.read_text()
        found = [gate for gate in gates if gate in text]
        assert not found, f"{path.relative_to(ROOT)} has {found}: see GENERATOR in gen_api.py"
