"""Compare ipu_unit_scaling with unit-scaling 0.3.5 itself, numerically, op by op.

    python scripts/unit_scaling_side_by_side.py [--wheel PATH] [--out FILE] [--require]

The library is loaded at run time from its wheel (``pip download`` as the conformance script does,
or ``--wheel``, default ``$IPU_UNIT_SCALING_LIBRARY_WHEEL``): the wheel is unpacked into a
temporary directory, its dependencies (einops, tabulate, docstring-parser) are taken from this
Python when installed and otherwise fetched the same way, and ``unit_scaling`` is imported from
there next to ``ipu_unit_scaling``. ``--wheel`` also takes a directory the library is installed
in (``pip install --target DIR unit-scaling==0.3.5``), which needs no network.

Every op and module both packages have runs on the same float64 inputs (parameters copied from
the library's module into ours), and its output and the gradients of its floating-point inputs and
parameters for the same random output gradient are compared. The difference of one tensor is
``max|ours - library| / max|library|``; a case's is the largest over its tensors. A case is

- ``equal`` when that is within float64 rounding (``EQUAL_WITHIN``),
- ``documented`` when it is larger and the case is one of the differences documented in
  docs/guide/coming-from-unit-scaling.md (named in the table),
- ``UNEXPECTED`` otherwise.

Then the library's example ``TransformerDecoder`` trains a few steps in both packages from the same
weights on the same batches, each with its ``uu.optim.AdamW``, and the two loss curves are printed.
Exit status: 0 when no case is UNEXPECTED, 1 otherwise; when the library cannot be loaded the
reason is printed and the status is 0 (2 with ``--require``).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from unit_scaling_conformance import VERSION, download_wheel  # noqa: E402

WHEEL_VARIABLE = "IPU_UNIT_SCALING_LIBRARY_WHEEL"
# Float64 rounding through a whole decoder is ~1e-14, float32's ~1e-6; the scales are exact.
EQUAL_WITHIN = {torch.float64: 1e-10, torch.float32: 1e-5}
LIBRARY_TORCH = (2, 2)  # the wheel's `torch>=2.2`
LIBRARY_PYTHON = (3, 9)  # its `Requires-Python: >=3.9`

# The differences kept on purpose (docs/guide/coming-from-unit-scaling.md), by short name.
SOFTMAX = "softmax: unit output std (library: unit rms)"
ATTENTION = "attention: exact per-row scale for the keys each query sees (library interpolates)"
BROADCAST = "matmul: a broadcast input's gradient counts its copies"
DROPOUT_EVAL = "dropout: identity in eval mode (library scales by sqrt(1-p))"
ACTIVATION = "gelu/silu: scales by quadrature for any mult (library interpolates)"
CROSS_ENTROPY = ("cross_entropy: input grad scale for unit-normal logits' softmax "
                 "(library: for a uniform softmax)")
MODULES = "the op differences above, in the module's ops"
ADD = ("add: a broadcast input's gradient counts its copies after the constraint; a single "
       "value leaves the other input's scale (library: both inside the constraint)")
FLOAT64_RMS = "rms_norm: float64 input normalised in float64 (library: its RMS in float32)"
# Differences that only rescale: each compared tensor is the library's times one constant.
SCALE_ONLY = {SOFTMAX, BROADCAST, DROPOUT_EVAL, ACTIVATION, CROSS_ENTROPY, ADD}


class LibraryUnavailable(Exception):
    """The library cannot be imported here; the message says why."""


@dataclass
class Api:
    """One package's public API: ``U`` (functional), ``uu`` (modules and the rest)."""

    U: ModuleType
    uu: ModuleType


@dataclass
class Case:
    """One comparison: ``inputs(generator)`` makes the inputs; ``run(api, inputs, module)`` the
    outputs; ``module(api)`` (optional) builds the module whose parameters are compared too."""

    name: str
    inputs: Callable[[torch.Generator], Dict[str, Tensor]]
    run: Callable[[Api, Dict[str, Tensor], Optional[nn.Module]], object]
    module: Optional[Callable[[Api], nn.Module]] = None
    documented: Optional[str] = None
    dtype: torch.dtype = torch.float64
    # For a module: the functional ops whose documented differences explain its difference; the
    # library's module run with ours in their place must then equal ours.
    explained_by: Tuple[str, ...] = ()


@dataclass
class Outcome:
    name: str
    difference: float
    worst: str
    verdict: str
    note: str = ""
    # Ours under ``rules("unit-scaling")`` against the library: the difference, its tensor, and
    # "equal" or "UNEXPECTED" (None: not run, the package has no switch).
    switched_difference: float = 0.0
    switched_worst: str = ""
    switched_verdict: Optional[str] = None


@dataclass
class Curves:
    library: List[float] = field(default_factory=list)
    ours: List[float] = field(default_factory=list)
    library_with_our_ops: List[float] = field(default_factory=list)
    ours_under_library_rules: List[float] = field(default_factory=list)


# --- loading the library -----------------------------------------------------------------------

_IMPORT_NAMES = {"docstring-parser": "docstring_parser"}


def _requirements(site: Path) -> List[str]:
    """The distribution names the installed library requires (no extras, no torch)."""
    metadata = next(site.glob("unit_scaling-*.dist-info/METADATA"), None)
    if metadata is None:
        raise LibraryUnavailable(f"no unit_scaling metadata in {site}")
    names = []
    for line in metadata.read_text(encoding="utf-8").splitlines():
        found = re.match(r"Requires-Dist:\s*([A-Za-z0-9_.-]+)([^;]*)$", line)
        if found and found.group(1).lower() != "torch":
            names.append(found.group(1))
    return names


def _unpack(wheel: Path, into: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(into)


def prepare_site(source: Optional[Path], scratch: Path, download: bool) -> Path:
    """A directory from which ``unit_scaling`` and its dependencies import."""
    if sys.version_info < LIBRARY_PYTHON:
        raise LibraryUnavailable(f"unit-scaling {VERSION} needs Python >= 3.9")
    if tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2]) < LIBRARY_TORCH:
        raise LibraryUnavailable(f"unit-scaling {VERSION} needs torch >= 2.2 "
                                 f"(this is {torch.__version__})")
    if source is not None and source.is_dir():
        site = source
    else:
        site = scratch / "site"
        site.mkdir(parents=True, exist_ok=True)
        if source is None:
            if not download:
                raise LibraryUnavailable("no wheel given (--wheel or $" + WHEEL_VARIABLE + ")")
            source = download_wheel(scratch)
        if not source.is_file():
            raise LibraryUnavailable(f"{source} is not a file")
        _unpack(source, site)
    for requirement in _requirements(site):
        module = _IMPORT_NAMES.get(requirement.lower(), requirement.lower().replace("-", "_"))
        if (site / module).exists() or importlib.util.find_spec(module) is not None:
            continue
        if not download:
            raise LibraryUnavailable(f"unit-scaling {VERSION} needs {requirement}, which is not "
                                     "installed (pip install it, or give an install directory)")
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                                  "--only-binary", ":all:", "-d", str(scratch / "deps"),
                                  requirement], capture_output=True, text=True)
        wheels = sorted((scratch / "deps").glob("*.whl")) if fetched.returncode == 0 else []
        if not wheels:
            raise LibraryUnavailable(f"unit-scaling {VERSION} needs {requirement}: "
                                     f"pip download failed: {fetched.stderr.strip()[-200:]}")
        for wheel in wheels:
            _unpack(wheel, site)
    return site


def load_library(site: Path) -> Api:
    if "unit_scaling" in sys.modules:
        loaded = Path(sys.modules["unit_scaling"].__file__ or "").resolve()
        if site.resolve() not in loaded.parents:
            raise LibraryUnavailable(f"another unit_scaling is already imported ({loaded})")
    sys.path.insert(0, str(site))
    try:
        uu = importlib.import_module("unit_scaling")
        U = importlib.import_module("unit_scaling.functional")
        importlib.import_module("unit_scaling.optim")
    except ImportError as error:
        raise LibraryUnavailable(f"unit_scaling from {site} does not import: {error}") from error
    version = getattr(uu, "__version__", None)
    if version is not None and version != VERSION:
        raise LibraryUnavailable(f"{site} holds unit-scaling {version}, not {VERSION}")
    return Api(U=U, uu=uu)


def load_ours() -> Api:
    return Api(U=importlib.import_module("ipu_unit_scaling.functional"),
               uu=importlib.import_module("ipu_unit_scaling"))


# --- the cases ---------------------------------------------------------------------------------

def normal(generator: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def ids(generator: torch.Generator, high: int, *shape: int) -> Tensor:
    return torch.randint(0, high, shape, generator=generator)


def _x(*shape: int) -> Callable[[torch.Generator], Dict[str, Tensor]]:
    return lambda g: {"x": normal(g, *shape)}


def _functional_cases() -> List[Case]:
    cases: List[Case] = []
    for shape in [(4, 32, 64), (8, 16)]:
        label = "x".join(map(str, shape))
        fan_in, fan_out = shape[-1], 48
        for bias in (False, True):
            for constraint in ("to_output_scale", None, "gmean"):
                cases.append(Case(
                    f"U.linear {label}->{fan_out} bias={bias} constraint={constraint}",
                    lambda g, s=shape, o=fan_out, b=bias: {
                        "x": normal(g, *s), "weight": normal(g, o, s[-1]),
                        **({"bias": normal(g, o)} if b else {})},
                    lambda a, t, _, c=constraint: a.U.linear(t["x"], t["weight"], t.get("bias"),
                                                           constraint=c)))
        cases.append(Case(
            f"U.linear_readout {label}->{fan_out}",
            lambda g, s=shape, o=fan_out: {"x": normal(g, *s), "weight": normal(g, o, s[-1])},
            lambda a, t, _: a.U.linear_readout(t["x"], t["weight"], None)))
        del fan_in
    for left, right, documented in [((64, 32), (32, 48), None), ((4, 64, 32), (4, 32, 48), None),
                                    ((16, 64, 32), (32, 48), BROADCAST)]:
        for constraint in ("to_output_scale", None):
            cases.append(Case(
                f"U.matmul {'x'.join(map(str, left))} @ {'x'.join(map(str, right))} "
                f"constraint={constraint}",
                lambda g, lt=left, rt=right: {"left": normal(g, *lt), "right": normal(g, *rt)},
                lambda a, t, _, c=constraint: a.U.matmul(t["left"], t["right"], constraint=c),
                documented=documented))
    for name in ("gelu", "silu"):
        for mult in (0.25, 1.0, 4.0):
            for constraint in ("to_output_scale", None):
                cases.append(Case(
                    f"U.{name} mult={mult} constraint={constraint}", _x(8, 256),
                    lambda a, t, _, n=name, m=mult, c=constraint:
                        getattr(a.U, n)(t["x"], mult=m, constraint=c),
                    documented=ACTIVATION))
    for mult in (0.25, 1.0, 4.0):
        cases.append(Case(
            f"U.silu_glu mult={mult}",
            lambda g: {"x": normal(g, 8, 256), "gate": normal(g, 8, 256)},
            lambda a, t, _, m=mult: a.U.silu_glu(t["x"], t["gate"], mult=m),
            documented=ACTIVATION))
    for n, mult in [(16, 1.0), (256, 0.25), (256, 4.0)]:
        for constraint in ("to_output_scale", None):
            cases.append(Case(
                f"U.softmax n={n} mult={mult} constraint={constraint}", _x(8, n),
                lambda a, t, _, m=mult, c=constraint:
                    a.U.softmax(t["x"], dim=-1, mult=m, constraint=c),
                documented=SOFTMAX))
    cases.append(Case("U.dropout p=0.1 eval", _x(8, 256),
                      lambda a, t, _: a.U.dropout(t["x"], 0.1, training=False),
                      documented=DROPOUT_EVAL))
    cases.append(Case("U.dropout p=0 train", _x(8, 256),
                      lambda a, t, _: a.U.dropout(t["x"], 0.0, training=True)))
    for shape in [(4, 16, 64), (32, 8)]:
        label = "x".join(map(str, shape))
        cases.append(Case(
            f"U.layer_norm {label} weight+bias",
            lambda g, s=shape: {"x": normal(g, *s), "weight": 1 + normal(g, s[-1]),
                                "bias": normal(g, s[-1])},
            lambda a, t, _: a.U.layer_norm(t["x"], t["x"].shape[-1:], t["weight"], t["bias"])))
        cases.append(Case(
            f"U.layer_norm {label}", _x(*shape),
            lambda a, t, _: a.U.layer_norm(t["x"], t["x"].shape[-1:])))
        for dtype in (torch.float64, torch.float32):
            precision = "" if dtype == torch.float64 else " float32"
            cases.append(Case(
                f"U.rms_norm {label} weight{precision}",
                lambda g, s=shape: {"x": normal(g, *s), "weight": 1 + normal(g, s[-1])},
                lambda a, t, _: a.U.rms_norm(t["x"], tuple(t["x"].shape[-1:]), t["weight"]),
                documented=FLOAT64_RMS if dtype == torch.float64 else None, dtype=dtype))
            cases.append(Case(
                f"U.rms_norm {label}{precision}", _x(*shape),
                lambda a, t, _: a.U.rms_norm(t["x"], tuple(t["x"].shape[-1:])),
                documented=FLOAT64_RMS if dtype == torch.float64 else None, dtype=dtype))
    for vocab, shape in [(100, (4, 32)), (1000, (64,))]:
        cases.append(Case(
            f"U.embedding vocab={vocab} ids={'x'.join(map(str, shape))}",
            lambda g, v=vocab, s=shape: {"ids": ids(g, v, *s), "weight": normal(g, v, 48)},
            lambda a, t, _: a.U.embedding(t["ids"], t["weight"])))
    for tau in (1.0, 0.5, 0.2):
        cases.append(Case(f"U.residual_split tau={tau}", _x(4, 16, 32),
                          lambda a, t, _, u=tau: a.U.residual_split(t["x"], tau=u)))
        cases.append(Case(
            f"U.residual_add tau={tau}",
            lambda g: {"residual": normal(g, 4, 16, 32), "skip": normal(g, 4, 16, 32)},
            lambda a, t, _, u=tau: a.U.residual_add(t["residual"], t["skip"], tau=u)))
        cases.append(Case(
            f"U.residual_apply(U.linear) tau={tau}",
            lambda g: {"x": normal(g, 4, 16, 32), "weight": normal(g, 32, 32)},
            lambda a, t, _, u=tau: a.U.residual_apply(
                lambda r: a.U.linear(r, t["weight"], None), t["x"], tau=u)))
    cases.append(Case(
        "U.add constraint=to_output_scale",
        lambda g: {"x": normal(g, 8, 32), "y": normal(g, 8, 32)},
        lambda a, t, _: a.U.add(t["x"], t["y"])))
    for constraint in ("to_output_scale", None):
        cases.append(Case(
            f"U.add 8x32 + 32 (broadcast) constraint={constraint}",
            lambda g: {"x": normal(g, 8, 32), "y": normal(g, 32)},
            lambda a, t, _, c=constraint: a.U.add(t["x"], t["y"], constraint=c),
            documented=ADD if constraint else None))
    cases.append(Case(
        "U.add 8x32 + one-element tensor",
        lambda g: {"x": normal(g, 8, 32), "y": normal(g, 1)},
        lambda a, t, _: a.U.add(t["x"], t["y"]), documented=ADD))
    for dtype in (torch.float64, torch.float32):
        cases.append(Case(
            f"core.functional.rms 4x16x64{' float32' if dtype == torch.float32 else ''}",
            _x(4, 16, 64), lambda a, t, _: a.uu.core.functional.rms(t["x"], dims=(-1,),
                                                                    keepdim=True, eps=1e-5),
            documented=FLOAT64_RMS if dtype == torch.float64 else None, dtype=dtype))
    cases.append(Case(
        "U.cross_entropy classes=50 batch=64, 16 targets ignored",
        lambda g: {"x": normal(g, 64, 50),
                   "target": torch.where(torch.arange(64) % 4 == 0, -100, ids(g, 50, 64))},
        lambda a, t, _: a.U.cross_entropy(t["x"], t["target"]), documented=CROSS_ENTROPY))
    for classes, batch, mult in [(10, 64, 1.0), (1000, 32, 1.0), (1000, 32, 0.5)]:
        cases.append(Case(
            f"U.cross_entropy classes={classes} batch={batch} mult={mult}",
            lambda g, c=classes, b=batch: {"x": normal(g, b, c), "target": ids(g, c, b)},
            lambda a, t, _, m=mult: a.U.cross_entropy(t["x"], t["target"], mult=m),
            documented=CROSS_ENTROPY))
    for reduction in ("mean", "sum"):
        cases.append(Case(
            f"U.mse_loss reduction={reduction}",
            lambda g: {"x": normal(g, 16, 32), "target": normal(g, 16, 32)},
            lambda a, t, _, r=reduction: a.U.mse_loss(t["x"], t["target"], reduction=r)))
    for seq, head, mult in [(16, 8, 1.0), (64, 32, 1.0), (64, 32, 8.0)]:
        for causal in (False, True):
            cases.append(Case(
                f"U.scaled_dot_product_attention seq={seq} head={head} mult={mult} "
                f"causal={causal}",
                lambda g, s=seq, d=head: {n: normal(g, 2, 4, s, d) for n in ("q", "k", "v")},
                lambda a, t, _, m=mult, c=causal: a.U.scaled_dot_product_attention(
                    t["q"], t["k"], t["v"], is_causal=c, mult=m),
                documented=ATTENTION))
    for bias in (False, True):
        cases.append(Case(
            f"U.conv1d 4x16x32, kernel 3, padding 1, bias={bias}",
            lambda g, b=bias: {"x": normal(g, 4, 16, 32), "weight": normal(g, 24, 16, 3),
                               **({"bias": normal(g, 24)} if b else {})},
            lambda a, t, _: a.U.conv1d(t["x"], t["weight"], t.get("bias"), padding=1)))
    return cases


def _module_case(name: str, build: Callable[[Api], nn.Module],
                 inputs: Callable[[torch.Generator], Dict[str, Tensor]],
                 call: Optional[Callable[[nn.Module, Dict[str, Tensor]], object]] = None,
                 explained_by: Tuple[str, ...] = (), dtype: torch.dtype = torch.float64) -> Case:
    def run(api: Api, tensors: Dict[str, Tensor], module: Optional[nn.Module]) -> object:
        assert module is not None
        return call(module, tensors) if call else module(*tensors.values())
    return Case(name, inputs, run, module=build, documented=MODULES if explained_by else None,
                dtype=dtype, explained_by=explained_by)


TRANSFORMER_OPS = ("scaled_dot_product_attention", "silu_glu", "rms_norm")
LOSS_OPS = TRANSFORMER_OPS + ("cross_entropy",)


def _module_cases() -> List[Case]:
    hidden, heads, vocab = 64, 4, 128

    def tokens(generator: torch.Generator) -> Dict[str, Tensor]:
        return {"ids": ids(generator, vocab, 4, 32)}

    return [
        _module_case("uu.Linear 64->96", lambda a: a.uu.Linear(64, 96), _x(4, 32, 64)),
        _module_case("uu.Linear 64->96 bias", lambda a: a.uu.Linear(64, 96, bias=True),
                     _x(4, 32, 64)),
        _module_case("uu.LinearReadout 64->128", lambda a: a.uu.LinearReadout(64, 128),
                     _x(4, 32, 64)),
        _module_case("uu.Conv1d 16->24 kernel 3", lambda a: a.uu.Conv1d(16, 24, 3),
                     _x(4, 16, 32)),
        _module_case("uu.Conv1d 16->24 kernel 3 bias",
                     lambda a: a.uu.Conv1d(16, 24, 3, bias=True), _x(4, 16, 32)),
        _module_case("uu.LayerNorm 64", lambda a: a.uu.LayerNorm(64), _x(4, 32, 64)),
        _module_case("uu.LayerNorm 64 affine",
                     lambda a: a.uu.LayerNorm(64, elementwise_affine=True), _x(4, 32, 64)),
        _module_case("uu.RMSNorm 64", lambda a: a.uu.RMSNorm(64), _x(4, 32, 64),
                     explained_by=("rms_norm",)),
        _module_case("uu.RMSNorm 64 affine",
                     lambda a: a.uu.RMSNorm(64, elementwise_affine=True), _x(4, 32, 64),
                     explained_by=("rms_norm",)),
        _module_case("uu.RMSNorm 64 affine float32",
                     lambda a: a.uu.RMSNorm(64, elementwise_affine=True), _x(4, 32, 64),
                     dtype=torch.float32),
        _module_case("uu.Embedding 128x64", lambda a: a.uu.Embedding(vocab, hidden), tokens),
        _module_case("uu.GELU mult=1", lambda a: a.uu.GELU(), _x(8, 256), explained_by=("gelu",)),
        _module_case("uu.SiLU mult=1", lambda a: a.uu.SiLU(), _x(8, 256), explained_by=("silu",)),
        _module_case("uu.Softmax dim=-1", lambda a: a.uu.Softmax(dim=-1), _x(8, 256),
                     explained_by=("softmax",)),
        _module_case("uu.Dropout p=0.1 eval", lambda a: a.uu.Dropout(0.1).eval(), _x(8, 256),
                     explained_by=("dropout",)),
        _module_case("uu.CrossEntropyLoss",
                     lambda a: a.uu.CrossEntropyLoss(),
                     lambda g: {"x": normal(g, 64, 100), "target": ids(g, 100, 64)},
                     explained_by=("cross_entropy",)),
        _module_case("uu.MLP 64", lambda a: a.uu.MLP(hidden), _x(4, 32, 64),
                     explained_by=("silu_glu",)),
        _module_case("uu.MHSA 64, 4 heads, causal=False",
                     lambda a: a.uu.MHSA(hidden, heads, is_causal=False), _x(4, 32, 64),
                     explained_by=("scaled_dot_product_attention",)),
        _module_case("uu.MHSA 64, 4 heads, causal=True",
                     lambda a: a.uu.MHSA(hidden, heads, is_causal=True), _x(4, 32, 64),
                     explained_by=("scaled_dot_product_attention",)),
        _module_case("uu.TransformerLayer 64, tau 0.5/0.3",
                     lambda a: a.uu.TransformerLayer(hidden, heads, mhsa_tau=0.5, mlp_tau=0.3,
                                                     is_causal=True),
                     _x(4, 32, 64), explained_by=TRANSFORMER_OPS),
        _module_case("uu.TransformerDecoder 64, 2 layers: logits",
                     lambda a: a.uu.TransformerDecoder(hidden, vocab, layers=2, heads=heads),
                     tokens, explained_by=TRANSFORMER_OPS),
        _module_case("uu.TransformerDecoder 64, 2 layers: loss",
                     lambda a: a.uu.TransformerDecoder(hidden, vocab, layers=2, heads=heads),
                     tokens, call=lambda m, t: m.loss(t["ids"]),  # type: ignore[operator]
                     explained_by=LOSS_OPS),
    ]


# Two models written only with the API both packages share (each built from ``api``): the
# library's example u-μP decoder (the model of its examples/demo.ipynb: pre-norm layers, a fused
# query-key-value linear, causal attention, SwiGLU, residual weights from
# ``transformer_residual_scaling_rule``, a readout), and a model of the other shared rules
# (GELU and SiLU-GLU with ``mult``, layer and RMS norm, embedding, residual split and add,
# ``LinearReadout``, cross entropy).

def _demo_decoder(api: Api, width: int = 64, head_size: int = 16, depth: int = 2,
                  vocab: int = 128, expansion: int = 2) -> nn.Module:
    uu, U = api.uu, api.U
    rule = uu.transformer_residual_scaling_rule()

    class Layer(nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.attn_norm, self.mlp_norm = uu.LayerNorm(width), uu.LayerNorm(width)
            self.attn_qkv = uu.Linear(width, 3 * width)
            self.attn_out = uu.Linear(width, width)
            self.mlp_up = uu.Linear(width, expansion * width)
            self.mlp_gate = uu.Linear(width, expansion * width)
            self.mlp_down = uu.Linear(expansion * width, width)
            self.attn_tau = rule(2 * index, 2 * depth)
            self.mlp_tau = rule(2 * index + 1, 2 * depth)

        def forward(self, x: Tensor) -> Tensor:
            branch, skip = U.residual_split(x, self.attn_tau)
            batch, length, _ = branch.shape
            q, k, v = (self.attn_qkv(self.attn_norm(branch))
                       .view(batch, length, 3, width // head_size, head_size)
                       .permute(2, 0, 3, 1, 4))
            mixed = U.scaled_dot_product_attention(q, k, v, is_causal=True)
            branch = self.attn_out(mixed.transpose(1, 2).reshape(batch, length, width))
            x = U.residual_add(branch, skip, self.attn_tau)
            branch, skip = U.residual_split(x, self.mlp_tau)
            branch = self.mlp_norm(branch)
            branch = self.mlp_down(U.silu_glu(self.mlp_up(branch), self.mlp_gate(branch)))
            return U.residual_add(branch, skip, self.mlp_tau)

    class Decoder(nn.Sequential):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = uu.Embedding(vocab, width)
            self.layers = uu.DepthSequential(*(Layer(i) for i in range(depth)))
            self.final_norm = uu.LayerNorm(width)
            self.projection = uu.LinearReadout(width, vocab)

        def loss(self, input_ids: Tensor) -> Tensor:
            logits = self(input_ids).float()
            return U.cross_entropy(logits[..., :-1, :].flatten(end_dim=-2),
                                   input_ids[..., 1:].flatten())

    return Decoder()


def _shared_rules_model(api: Api, width: int = 32, vocab: int = 50, depth: int = 2,
                        gelu_mult: float = 0.75, glu_mult: float = 1.5) -> nn.Module:
    uu, U = api.uu, api.U

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm_1 = uu.RMSNorm(width, elementwise_affine=True)
            self.up = uu.Linear(width, 2 * width)
            self.act = uu.GELU(mult=gelu_mult)
            self.down = uu.Linear(2 * width, width)
            self.norm_2 = uu.LayerNorm(width, elementwise_affine=True)
            self.value = uu.Linear(width, 2 * width)
            self.gate = uu.Linear(width, 2 * width)
            self.out = uu.Linear(2 * width, width)

        def forward(self, x: Tensor) -> Tensor:
            branch, skip = U.residual_split(x, 0.5)
            x = U.residual_add(self.down(self.act(self.up(self.norm_1(branch)))), skip, 0.5)
            branch, skip = U.residual_split(x, 0.4)
            branch = self.norm_2(branch)
            glu = U.silu_glu(self.value(branch), self.gate(branch), mult=glu_mult)
            return U.residual_add(self.out(glu), skip, 0.4)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = uu.Embedding(vocab, width)
            self.blocks = uu.DepthSequential(*(Block() for _ in range(depth)))
            self.readout = uu.LinearReadout(width, vocab)

        def loss(self, input_ids: Tensor) -> Tensor:
            logits = self.readout(self.blocks(self.embedding(input_ids)))
            return U.cross_entropy(logits[..., :-1, :].flatten(end_dim=-2),
                                   input_ids[..., 1:].flatten())

    return Model()


def _model_cases() -> List[Case]:
    def tokens(vocab: int) -> Callable[[torch.Generator], Dict[str, Tensor]]:
        return lambda g: {"ids": ids(g, vocab, 4, 32)}

    def loss(module: nn.Module, tensors: Dict[str, Tensor]) -> object:
        return module.loss(tensors["ids"])  # type: ignore[operator]

    cases = []
    for dtype in (torch.float64, torch.float32):
        suffix = " float32" if dtype == torch.float32 else ""
        cases.append(_module_case(
            f"the library's example u-μP decoder (demo.ipynb's model): loss{suffix}",
            _demo_decoder, tokens(128), call=loss, dtype=dtype,
            explained_by=("scaled_dot_product_attention", "silu_glu", "cross_entropy")))
        cases.append(_module_case(
            f"a model of the other shared rules (GELU, SiLU-GLU with mult, norms): loss{suffix}",
            _shared_rules_model, tokens(50), call=loss, dtype=dtype,
            explained_by=("gelu", "silu_glu", "rms_norm", "cross_entropy")))
    return cases


def all_cases() -> List[Case]:
    return _functional_cases() + _module_cases() + _model_cases()


# --- running and comparing ---------------------------------------------------------------------

def _outputs(result: object) -> List[Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]  # type: ignore


def _evaluate(api: Api, case: Case, inputs: Dict[str, Tensor], library_module: Optional[nn.Module],
              seed: int) -> Dict[str, Tensor]:
    """The case's outputs and the gradients of its float inputs and parameters, by name; for a
    module also its initial parameters (built from the same seed) before the library's trained-like
    parameters are loaded into it."""
    named: Dict[str, Tensor] = {}
    module: Optional[nn.Module] = None
    if case.module is not None:
        assert library_module is not None
        torch.manual_seed(seed)
        module = case.module(api)
        named.update({f"init {name}": value.detach().clone()
                      for name, value in module.state_dict().items()})
        module.load_state_dict(library_module.state_dict())
        module.to(case.dtype)
    # Fresh copies: the two packages' gradients must not accumulate into one tensor.
    leaves = {name: tensor.detach().clone().to(case.dtype if tensor.is_floating_point()
                                               else tensor.dtype)
              .requires_grad_(tensor.is_floating_point()) for name, tensor in inputs.items()}
    torch.manual_seed(seed)
    outputs = _outputs(case.run(api, leaves, module))
    generator = torch.Generator().manual_seed(seed + 1)
    output_grads = [normal(generator, *output.shape).to(output.dtype) for output in outputs]
    differentiable = [(o, g) for o, g in zip(outputs, output_grads) if o.requires_grad]
    if differentiable:
        torch.autograd.backward([o for o, _ in differentiable], [g for _, g in differentiable])
    named.update({f"output{i}" if len(outputs) > 1 else "output": o.detach()
                  for i, o in enumerate(outputs)})
    for name, leaf in leaves.items():
        if leaf.requires_grad:
            named[f"grad {name}"] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    for name, parameter in (module.named_parameters() if module is not None else []):
        named[f"grad {name}"] = (parameter.grad if parameter.grad is not None
                                 else torch.zeros_like(parameter))
    return named


def relative_difference(ours: Tensor, library: Tensor) -> float:
    """``max|ours - library| / max|library|`` (0 for two zero tensors, inf for a shape change)."""
    if ours.shape != library.shape:
        return float("inf")
    ours, library = ours.double(), library.double()
    scale = library.abs().max().item() if library.numel() else 0.0
    error = (ours - library).abs().max().item() if library.numel() else 0.0
    return error / scale if scale > 0 else (0.0 if error == 0 else float("inf"))


def constant_factor(ours: Tensor, library: Tensor) -> Tuple[float, float]:
    """The least-squares ``c`` in ``ours ~ c * library``, and the relative difference left."""
    ours, library = ours.double().flatten(), library.double().flatten()
    norm = library.dot(library).item()
    factor = ours.dot(library).item() / norm if norm > 0 else 1.0
    return factor, relative_difference(ours, factor * library)


@contextmanager
def library_using_our_ops(library: Api, ours: Api, names: Sequence[str]) -> Iterator[None]:
    """The library's modules call ``U.<name>`` at run time: point those names at our ops."""
    saved = {name: getattr(library.U, name) for name in names}
    try:
        for name in names:
            setattr(library.U, name, getattr(ours.U, name))
        yield
    finally:
        for name, op in saved.items():
            setattr(library.U, name, op)


LIBRARY_RULES = "unit-scaling"  # the name of the library's rules in ``uu.rules``


def under_library_rules(api: Api):
    """``api.uu.rules("unit-scaling")``: our package following the library's rules (a no-op
    context when the package has no such switch)."""
    switch = getattr(api.uu, "rules", None)
    return switch(LIBRARY_RULES) if switch is not None else nullcontext()


def compare(case: Case, ours: Api, library: Api, seed: int = 0) -> Outcome:
    inputs = case.inputs(torch.Generator().manual_seed(seed))
    library_module: Optional[nn.Module] = None
    try:
        if case.module is not None:
            torch.manual_seed(seed)
            library_module = case.module(library)
            library_module.to(case.dtype)
            # Away from the initial values (zero biases, unit gains), so every parameter counts.
            generator = torch.Generator().manual_seed(seed + 2)
            with torch.no_grad():
                for parameter in library_module.parameters():
                    parameter.add_(0.5 * normal(generator, *parameter.shape).to(case.dtype))
        theirs = _evaluate(library, case, inputs, library_module, seed)
        mine = _evaluate(ours, case, inputs, library_module, seed)
        switched: Optional[Dict[str, Tensor]] = None
        if getattr(ours.uu, "rules", None) is not None:
            with under_library_rules(ours):
                switched = _evaluate(ours, case, inputs, library_module, seed)
        if case.explained_by:
            with library_using_our_ops(library, ours, case.explained_by):
                theirs_with_ours = _evaluate(library, case, inputs, library_module, seed)
    except Exception as error:  # noqa: BLE001 - a failure to run is a finding, not a crash
        return Outcome(case.name, float("inf"), "", "UNEXPECTED",
                       f"{type(error).__name__}: {error}".splitlines()[0][:160])
    differences = {name: relative_difference(mine[name], theirs[name]) if name in mine
                   else float("inf") for name in theirs}
    missing = sorted(set(mine) - set(theirs))
    worst = max(differences, key=differences.__getitem__)
    difference = differences[worst]
    tolerance = EQUAL_WITHIN[case.dtype]
    note = f"ours has extra {missing}" if missing else ""
    if difference <= tolerance and not missing:
        verdict = "equal"
    elif case.documented is not None and not missing:
        verdict, note = "documented", case.documented
        if case.documented in SCALE_ONLY:
            fits = {name: constant_factor(mine[name], theirs[name]) for name in theirs}
            left = max(rest for _, rest in fits.values())
            factors = [factor for factor, _ in fits.values()]
            note += f"; ours = library x {min(factors):.3f}..{max(factors):.3f}"
            if left > tolerance:  # more than a rescaling: not the documented difference
                verdict, note = "UNEXPECTED", note + f", but {left:.1e} more than a rescaling"
        if case.explained_by:
            ops = ", ".join(f"U.{name}" for name in case.explained_by)
            left = max(relative_difference(mine[name], theirs_with_ours[name]) for name in theirs)
            note = f"{ops}; {left:.1e} when the library's module runs our {ops}"
            if left > tolerance:
                verdict = "UNEXPECTED"
    else:
        verdict = "UNEXPECTED"
    outcome = Outcome(case.name, difference, worst, verdict, note)
    if switched is not None:
        # Under the switch every case must be equal: each kept rule follows the library's.
        switched_differences = {name: relative_difference(switched[name], theirs[name])
                                if name in switched else float("inf") for name in theirs}
        outcome.switched_worst = max(switched_differences, key=switched_differences.__getitem__)
        outcome.switched_difference = switched_differences[outcome.switched_worst]
        outcome.switched_verdict = ("equal" if outcome.switched_difference <= tolerance
                                    and set(switched) == set(theirs) else "UNEXPECTED")
    return outcome


# --- the example decoder, trained by both ------------------------------------------------------

def train_side_by_side(ours: Api, library: Api, steps: int = 8, seed: int = 0,
                       hidden: int = 64, vocab: int = 128, layers: int = 2, heads: int = 4,
                       batch: Tuple[int, int] = (8, 32), lr: float = 0.05) -> Curves:
    """The library's example ``TransformerDecoder`` trained by both packages (float32, as the
    library's example runs) from the library's initial weights on the same batches."""
    torch.manual_seed(seed)
    library_model = library.uu.TransformerDecoder(hidden, vocab, layers=layers, heads=heads)
    our_model = ours.uu.TransformerDecoder(hidden, vocab, layers=layers, heads=heads)
    our_model.load_state_dict(library_model.state_dict())
    patched_model = library.uu.TransformerDecoder(hidden, vocab, layers=layers, heads=heads)
    patched_model.load_state_dict(library_model.state_dict())
    generator = torch.Generator().manual_seed(seed + 1)
    # Each batch counts up from a random start: a sequence the decoder can learn in a few steps.
    batches = [(torch.randint(0, vocab, (batch[0], 1), generator=generator)
                + torch.arange(batch[1])) % vocab for _ in range(steps)]
    curves = Curves()
    switched_model = ours.uu.TransformerDecoder(hidden, vocab, layers=layers, heads=heads)
    switched_model.load_state_dict(library_model.state_dict())
    runs = [(library, library_model, curves.library, (), False),
            (ours, our_model, curves.ours, (), False),
            (library, patched_model, curves.library_with_our_ops, LOSS_OPS, False),
            (ours, switched_model, curves.ours_under_library_rules, (), True)]
    for api, model, losses, our_ops, switch in runs:
        if switch and getattr(ours.uu, "rules", None) is None:
            continue
        optimizer = api.uu.optim.AdamW(model.parameters(), lr=lr)
        with library_using_our_ops(library, ours, our_ops), \
                (under_library_rules(ours) if switch else nullcontext()):
            for input_ids in batches:
                optimizer.zero_grad()
                loss = model.loss(input_ids)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
    return curves


# Float32 unit roundoff, and a bound on the roundings that reach one step's loss: each step's
# forward and backward chain about 40 ops, the longest a sum of 256 terms (a sequence of 32 times
# the batch of 8), so 1024 bounds the roundings per value; each earlier step's parameters carry
# their own, hence the (step + 1).
FLOAT32_UNIT_ROUNDOFF = 2.0**-24
ROUNDINGS_PER_STEP = 1024


def curves_follow(curves: Curves) -> bool:
    """Whether ours under the library's rules trains as the library does, step by step, to
    float32 rounding."""
    return all(abs(follows - theirs) <= abs(theirs) * FLOAT32_UNIT_ROUNDOFF * ROUNDINGS_PER_STEP
               * (step + 1) for step, (follows, theirs)
               in enumerate(zip(curves.ours_under_library_rules, curves.library)))


# --- report ------------------------------------------------------------------------------------

def format_report(outcomes: Sequence[Outcome], curves: Optional[Curves]) -> str:
    switched = any(outcome.switched_verdict is not None for outcome in outcomes)
    header = "| case | max relative difference (tensor) | verdict |"
    rule = "|---|---|---|"
    if switched:
        header += f' under uu.rules("{LIBRARY_RULES}") |'
        rule += "---|"
    lines = [header, rule]
    for outcome in outcomes:
        verdict = outcome.verdict + (f": {outcome.note}" if outcome.note else "")
        where = f" ({outcome.worst})" if outcome.worst else ""
        row = f"| {outcome.name} | {outcome.difference:.1e}{where} | {verdict} |"
        if switched:
            row += (f" {outcome.switched_verdict}, {outcome.switched_difference:.1e}"
                    f" ({outcome.switched_worst}) |")
        lines.append(row)
    counts = {verdict: sum(o.verdict == verdict for o in outcomes)
              for verdict in ("equal", "documented", "UNEXPECTED")}
    summary = (f"unit-scaling {VERSION} side by side: {len(outcomes)} cases, "
               f"{counts['equal']} equal, {counts['documented']} documented differences, "
               f"{counts['UNEXPECTED']} UNEXPECTED")
    if switched:
        equal = sum(o.switched_verdict == "equal" for o in outcomes)
        summary += (f'; under uu.rules("{LIBRARY_RULES}"): {equal} equal, '
                    f"{len(outcomes) - equal} UNEXPECTED")
    lines += ["", summary]
    if curves is not None:
        ops = ", ".join(f"U.{name}" for name in LOSS_OPS)
        lines += ["", "TransformerDecoder(64, vocab 128, 2 layers, 4 heads), each package's "
                  "uu.optim.AdamW, lr 0.05, batches 8x32, float32, the library's initial weights "
                  f"in all; 'unit-scaling, our ops' is the library's decoder running our {ops}"
                  + (f'; the last two columns are ours under uu.rules("{LIBRARY_RULES}")'
                     if curves.ours_under_library_rules else "") + ":", ""]
        header = ("| step | unit-scaling | ipu_unit_scaling | difference | unit-scaling, our ops |"
                  " ipu_unit_scaling minus that |")
        rule = "|---|---|---|---|---|---|"
        if curves.ours_under_library_rules:
            header += " ipu_unit_scaling, library's rules | minus unit-scaling |"
            rule += "---|---|"
        lines += [header, rule]
        for step, (theirs, mine, patched) in enumerate(
                zip(curves.library, curves.ours, curves.library_with_our_ops)):
            row = (f"| {step} | {theirs:.6f} | {mine:.6f} | {mine - theirs:+.6f} | "
                   f"{patched:.6f} | {mine - patched:+.1e} |")
            if curves.ours_under_library_rules:
                follows = curves.ours_under_library_rules[step]
                row += f" {follows:.6f} | {follows - theirs:+.1e} |"
            lines.append(row)
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    given = os.environ.get(WHEEL_VARIABLE)
    parser.add_argument("--wheel", type=Path, default=Path(given) if given else None,
                        help="the unit_scaling wheel or a directory it is installed in "
                             f"(default: ${WHEEL_VARIABLE}, else pip download)")
    parser.add_argument("--no-download", action="store_true",
                        help="never run pip download; report the library as unavailable instead")
    parser.add_argument("--require", action="store_true",
                        help="exit 2 when the library cannot be loaded (default: say why, exit 0)")
    parser.add_argument("--steps", type=int, default=8, help="training steps (0: none)")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)

    torch.set_num_threads(min(torch.get_num_threads(), 2))
    with tempfile.TemporaryDirectory(prefix="unit-scaling-side-by-side-") as scratch:
        try:
            library = load_library(prepare_site(args.wheel, Path(scratch), not args.no_download))
        except (LibraryUnavailable, subprocess.CalledProcessError) as error:
            print(f"unit-scaling {VERSION} side by side skipped: {error}")
            return 2 if args.require else 0
        ours = load_ours()
        outcomes = [compare(case, ours, library) for case in all_cases()]
        curves = train_side_by_side(ours, library, steps=args.steps) if args.steps else None
    report = format_report(outcomes, curves)
    sys.stdout.write(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report, encoding="utf-8")
    failed = any(outcome.verdict == "UNEXPECTED" or outcome.switched_verdict == "UNEXPECTED"
                 for outcome in outcomes)
    if curves is not None and curves.ours_under_library_rules:
        failed = failed or not curves_follow(curves)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
