"""Packaging for ipu-unit-scaling."""
from setuptools import find_packages, setup

setup(
    name="ipu-unit-scaling",
    version="0.1.0",
    description="Unit scaling and FP8-AMAX for PyTorch, IPU-first, with a CPU fallback",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.8",
    packages=find_packages(include=["ipu_unit_scaling", "ipu_unit_scaling.*"]),
    install_requires=["torch>=2.0", "numpy", "pyyaml"],
    extras_require={
        "test": ["pytest", "hypothesis", "ml_dtypes", "gfloat", "ruff", "mypy", "types-PyYAML", "transformers"],
        "analysis": ["matplotlib"],
    },
    entry_points={"console_scripts": ["ipu-unit-scaling=ipu_unit_scaling.cli:main"]},
)
