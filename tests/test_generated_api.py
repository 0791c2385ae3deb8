"""The checked-in generated code under src/tslice/api must match proto/ (run `make api`)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _gen_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "scripts" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_api"] = module
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh() -> None:
    pytest.importorskip("grpc_tools")
    gen = _gen_module()
    with tempfile.TemporaryDirectory() as tmp:
        gen.generate(pathlib.Path(tmp))
        fresh = gen.snapshot(pathlib.Path(tmp))
    checked_in = gen.snapshot(ROOT / "src" / "tslice" / "api")
    stale = sorted(k for k in fresh if checked_in.get(k) != fresh[k])
    extra = sorted(k for k in checked_in if k not in fresh)
    assert not stale and not extra, f"stale generated files {stale + extra}: run `make api`"
