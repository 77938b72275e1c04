"""How the codelets and the PopXL binding are built, checked without the Poplar SDK.

CMake is run against a stand-in popc that records its command line, and the PopXL binding's
cppimport settings and pybind11 checks are exercised with stand-in modules.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from helpers import ROOT as REPO

from ipu_unit_scaling.backends.popxl import codelets

FAKE_POPC = """#!/bin/sh
if [ "$1" = "--list-targets" ]; then echo "cpu,ipu2,ipu21"; exit 0; fi
out=""; previous=""
for arg in "$@"; do
  if [ "$previous" = "-o" ]; then out="$arg"; fi
  previous="$arg"
done
printf '%s\\n' "$@" > "$out"
"""


def build_codelets(tmp_path: Path, *options: str) -> list:
    """Configure custom_ops/ with a stand-in SDK and build only the codelets: popc's args."""
    cmake = shutil.which("cmake")
    if cmake is None or shutil.which("c++") is None:
        pytest.skip("cmake or a C++ compiler is missing")
    sdk = tmp_path / "sdk"
    (sdk / "bin").mkdir(parents=True)
    (sdk / "lib").mkdir()
    popc = sdk / "bin" / "popc"
    popc.write_text(FAKE_POPC)
    popc.chmod(0o755)
    for library in ("popart", "poplar", "poputil", "popops"):
        (sdk / "lib" / f"lib{library}.so").touch()
    build = tmp_path / "build"
    subprocess.run([cmake, "-S", str(REPO / "custom_ops"), "-B", str(build),
                    f"-DCMAKE_PROGRAM_PATH={sdk / 'bin'}", f"-DCMAKE_LIBRARY_PATH={sdk / 'lib'}",
                    *options], check=True, capture_output=True)
    (tmp_path / "build_rules.txt").write_text("\n".join(
        path.read_text(errors="replace") for path in build.rglob("*")
        if path.is_file() and path.name in ("build.make", "build.ninja", "link.txt")))
    subprocess.run([cmake, "--build", str(build), "--target", "fp8_codelets"], check=True,
                   capture_output=True)
    return (build / "fp8_codelets.gp").read_text().split("\n")


def test_popc_is_given_every_target_it_lists(tmp_path):
    args = build_codelets(tmp_path)
    assert args[args.index("--target") + 1] == "cpu,ipu2,ipu21"
    assert "-O3" in args and str(REPO / "codelets" / "fp8_codelets.cpp") in args


def test_the_codelet_targets_can_be_named(tmp_path):
    args = build_codelets(tmp_path, "-DIUS_CODELET_TARGETS=ipu21")
    assert args[args.index("--target") + 1] == "ipu21"


def test_the_custom_op_library_compiles_every_popart_op_and_links_popops(tmp_path):
    build_codelets(tmp_path)
    rules = (tmp_path / "build_rules.txt").read_text()
    sources = sorted(path.name for path in (REPO / "custom_ops").glob("*.cpp")
                     if not path.name.startswith("popxl_"))  # built by cppimport instead
    assert "scaled_identity.cpp" in sources
    for source in sources:
        assert f"{source}.o" in rules, source
    # ScaledIdentity's multiply is a popops map.
    assert re.search(r"libpopops\.so|-lpopops\b", rules)


def test_the_popxl_binding_is_a_cppimport_module():
    source = codelets.SOURCE.read_text()
    assert source.startswith("// cppimport\n")  # cppimport's opt-in, on the first line
    assert f"PYBIND11_MODULE({codelets.MODULE_NAME}, m)" in source
    # Run the build settings as cppimport's Mako step would, with its variables.
    block = re.search(r"<%\n(.*?)\n%>", source, re.S)
    assert block is not None
    cfg: dict = {"sources": [], "include_dirs": [], "extra_compile_args": [], "libraries": [],
                 "dependencies": []}
    exec(block.group(1), {"cfg": cfg, "filepath": str(codelets.SOURCE),
                          "setup_pybind11": lambda c: c["extra_compile_args"].append("pybind")})
    assert cfg["sources"] == ["fp8_graph.cpp"]
    codelet_dir = str((REPO / "codelets").resolve())
    assert cfg["include_dirs"] == [codelet_dir]
    assert f'-DIUS_CODELETS_DIR="{codelet_dir}"' in cfg["extra_compile_args"]
    assert "-DONNX_NAMESPACE=onnx" in cfg["extra_compile_args"]
    assert cfg["extra_compile_args"][-1] == "pybind"  # setup_pybind11 ran last
    assert set(cfg["libraries"]) == {"popart", "poplar", "poputil"}
    for dependency in cfg["dependencies"]:
        assert (codelets.SOURCE.parent / dependency).exists(), dependency


def fake_build_tools(monkeypatch, pybind11_version):
    monkeypatch.delenv(codelets.BINDING_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "cppimport", types.ModuleType("cppimport"))
    pybind11 = types.ModuleType("pybind11")
    pybind11.__version__ = pybind11_version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pybind11", pybind11)


def test_the_binding_is_built_with_popart_s_pybind11(monkeypatch):
    fake_build_tools(monkeypatch, codelets.POPART_PYBIND11)
    assert codelets.binding_path() == codelets.SOURCE
    fake_build_tools(monkeypatch, "2.13.6")
    with pytest.raises(ImportError, match=r"pybind11 2\.6\.2, the release popart"):
        codelets.binding_path()


def test_without_cppimport_the_error_says_what_to_install(monkeypatch):
    monkeypatch.delenv(codelets.BINDING_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "cppimport", None)  # import fails
    with pytest.raises(ImportError, match="pip install cppimport pybind11==2.6.2"):
        codelets.binding_path()
    monkeypatch.setenv(codelets.BINDING_ENV, "/somewhere/ius_popxl_ops.so")
    assert codelets.binding_path() == Path("/somewhere/ius_popxl_ops.so")


def test_a_binding_with_its_own_pybind11_registry_is_refused():
    popart = {"__pybind11_internals_v4_gcc_libstdcpp_cxxabi1011__"}
    codelets.check_shared_internals(popart, set(popart), Path("m.so"))  # shared: fine
    codelets.check_shared_internals(set(), {"__pybind11_internals_v5__"}, Path("m.so"))
    with pytest.raises(ImportError, match="differ from popart._internal.ir's"):
        codelets.check_shared_internals(popart, popart | {"__pybind11_internals_v5_x__"},
                                        Path("m.so"))
