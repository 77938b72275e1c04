"""Packaging for ipu-unit-scaling."""
from __future__ import annotations

import glob
import os
import re
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


class BuildHostLibrary(build_ext):
    """Compiles the FP8 codelets for the host as a plain C ABI library (loaded with ctypes).

    Needs only a C++17 compiler, not torch. If the build fails (no compiler, say), the install
    still succeeds with a warning and the package runs on its torch path.
    """

    def get_ext_filename(self, fullname: str) -> str:
        # Not a Python extension module: a fixed name that ipu_unit_scaling.fp8.host_library
        # looks for.
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as error:  # compiler missing or failing: keep the install going
            sys.stderr.write(
                f"WARNING: could not build {ext.name} ({error}); the FP8 host fast path and the "
                "codelet emulator are off, casts use the torch path.\n")


host_library = Extension(
    "ipu_unit_scaling.fp8._fp8_host",
    sources=["codelets/host/fp8_host.cpp", "codelets/fp8_block_host.cpp"],
    include_dirs=["codelets/host_shim"],
    depends=["codelets/fp8_codelets.cpp", "codelets/fp8_block_codelets.cpp",
             "codelets/fp8_arith.hpp", "codelets/partition.hpp",
             "codelets/placement.hpp",
             "codelets/host/fp8_fused.hpp", "codelets/host/fp8_fast.hpp",
             "codelets/host/fp8_simd.hpp", "codelets/host/fp8_groups.hpp",
             "codelets/host/fp8_rowwise.hpp", "codelets/host/fp8_subbyte.hpp",
             "codelets/host_shim/poplar/Vertex.hpp", "codelets/host_shim/poplar/HalfFloat.hpp"],
    language="c++",
    # -fno-trapping-math lets the branch-free selects vectorise; it does not change results.
    extra_compile_args=["-std=c++17", "-O3", "-fno-trapping-math", "-fvisibility=hidden",
                        "-pthread"],
    extra_link_args=["-pthread"],
    optional=True,
)

def package_version() -> str:
    """``__version__`` of the package, read without importing it (that needs torch)."""
    with open(os.path.join("ipu_unit_scaling", "__init__.py"), encoding="utf-8") as source:
        match = re.search(r'^__version__ = "([^"]+)"$', source.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError("ipu_unit_scaling/__init__.py defines no __version__")
    return match.group(1)


setup(
    name="ipu-unit-scaling",
    version=package_version(),
    description="Unit scaling and FP8-AMAX for PyTorch, IPU-first, with a CPU fallback",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.8",
    # ipu_standins: the stand-ins for the Poplar SDK's PopTorch and PopXL, a package of their
    # own that depends on torch alone (`ipu-unit-scaling emulate` serves them).
    packages=find_packages(include=["ipu_unit_scaling", "ipu_unit_scaling.*", "ipu_standins",
                                    "ipu_standins.*"]),
    # The C++ transformer-layer nodes, compiled on first use against the installed torch.
    package_data={"ipu_unit_scaling.ops": ["native_layers.cpp", "native_casts.hpp"]},
    # matplotlib draws the loss curves every run writes: the main job needs it.
    # ninja builds the C++ transformer-layer nodes on first use (ops/native_layers.py).
    install_requires=["torch>=2.0", "numpy", "pyyaml", "tqdm", "matplotlib", "ninja"],
    extras_require={
        # tensorboard: the tests read back the event files training writes when it is there.
        # transformers: unit_scale's Hugging Face tests. unit_scale supports 4.29 (Optimum
        # Graphcore's pin) and 5.19 up to 6, tested on 4.29.2, 5.19.0 and 5.25.0 (CI runs the
        # oldest and the newest; transforms.fx_tracing.TRANSFORMERS_TESTED) and refuses a Hugging
        # Face model on any other release. The tests install the 5.x line; CI's step 1d, 4.29.2.
        "test": ["pytest", "hypothesis", "ml_dtypes", "gfloat", "ruff", "mypy", "types-PyYAML",
                 "transformers>=5.19,<6", "tensorboard"],
        "analysis": [],  # kept so that install lines naming it still work
        "bench": ["unit-scaling"],
        # Training also logs its scalars to <run_dir>/tensorboard/ where TensorBoard imports.
        "tensorboard": ["tensorboard"],
        # mkdocs.yml's site: the guide in docs/ and the API reference from the docstrings.
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
    },
    entry_points={"console_scripts": ["ipu-unit-scaling=ipu_unit_scaling.apps.cli:command"]},
    # Named configs for installs without a source checkout (see config.CONFIGS_DIR).
    data_files=[("share/ipu-unit-scaling/configs", sorted(glob.glob("configs/*.yaml")))],
    ext_modules=[host_library],
    cmdclass={"build_ext": BuildHostLibrary},
)
