"""The C++ nodes of the transformer layer's two Functions (`ops.native_layers`) against the
Python Functions they stand for, argument by argument, and the fall-back where they are off."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch
from helpers import backward_nodes, built_native_layers

from ipu_unit_scaling.ops import fused_blocks, native_layers

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def native():
    return built_native_layers()


def _tensors(dtype: torch.dtype, seed: int, **shapes) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()
            for name, shape in shapes.items()}


# Both forms call the same kernels with the same arguments in the same order, so their values
# agree; only MKL, whose GEMM blocking may follow the buffers' alignment, could sum a <= 64-term
# dot product in another order: 64 unit roundoffs relative at most (float32 2**-24: 3.8e-6;
# float64 2**-53: 7.1e-15), carried through a norm and two more GEMMs: 1e-5 and 1e-13.
_RTOL = {torch.float32: 1e-5, torch.float64: 1e-13}


def _assert_same(got: List[Optional[torch.Tensor]], want: List[Optional[torch.Tensor]],
                 dtype: torch.dtype) -> None:
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), index
        if b is not None:
            rtol = _RTOL[dtype]
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item(),
                                       msg=f"tensor {index}")


def _run(function, args: list, inputs: List[torch.Tensor], seed: int) -> list:
    """Outputs, then each input's gradient, of ``function(*args)`` under random output
    gradients."""
    for tensor in inputs:
        tensor.grad = None
    outputs = function(*args)
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(out.shape, generator=generator, dtype=out.dtype) for out in outputs]
    torch.autograd.backward(list(outputs), grads)
    return [out.detach().clone() for out in outputs] + [
        None if tensor.grad is None else tensor.grad.clone() for tensor in inputs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("joined", ["none", "unit branch", "weighted branch"])
@pytest.mark.parametrize("biases", [False, True])
def test_norm_qkv_node_matches_the_python_function(native, dtype, joined, biases):
    t = _tensors(dtype, 0, x=(2, 5, 16), f=(2, 5, 16), weight=(16,), bias=(16,),
                 qkv_weight=(48, 16), qkv_bias=(48,))
    f = None if joined == "none" else t["f"]
    branch_weight = 1.0 if joined == "unit branch" else 0.6
    weight, bias = (t["weight"], t["bias"]) if biases else (None, None)
    qkv_bias = t["qkv_bias"] if biases else None
    args = [t["x"], f, branch_weight, 0.8, 0.45, 0.9, weight, bias, 1e-5, 0.3, t["qkv_weight"],
            qkv_bias, (0.25, 0.5, 0.125)]
    inputs = [t[name] for name in ("x", "f", "weight", "bias", "qkv_weight", "qkv_bias")]
    python = _run(lambda *a: fused_blocks._normqkv_apply(*a, None), args, inputs, seed=1)
    _assert_same(_run(lambda *a: native.norm_qkv(*a, FLOAT_CASTS), args, inputs, seed=1),
                 python, dtype)


# A float linear's casts, as the nodes take them (input, weight, output gradient).
FLOAT_CASTS = [[], [], []]


def _proj_norm_mlp_args(dtype: torch.dtype, row_scale: str, biases: bool, seq: int = 5):
    t = _tensors(dtype, 2, heads=(2, 4, seq, 4), proj_weight=(16, 16), stream=(2, seq, 16),
                 norm_weight=(16,), norm_bias=(16,), up_weight=(64, 16), up_bias=(64,),
                 down_weight=(16, 64), down_bias=(16,))
    scale = (torch.linspace(0.5, 1.5, seq, dtype=dtype).view(seq, 1) if row_scale == "tensor"
             else 1.3)
    optional = {name: t[name] if biases else None
                for name in ("norm_weight", "norm_bias", "up_bias", "down_bias")}
    python_args = [t["heads"], scale, t["proj_weight"], (0.5, 0.25, 0.75), t["stream"],
                   optional["norm_weight"], optional["norm_bias"],
                   (0.6, 0.8, 0.45, 0.9, 1e-5, 0.3, 0.7), t["up_weight"], optional["up_bias"],
                   t["down_weight"], optional["down_bias"], "none",
                   (0.25, 0.5, 0.125, 1.2, 0.9, 0.35, 0.65, 0.15)]
    native_args = [python_args[0], scale if row_scale == "tensor" else None,
                   1.0 if row_scale == "tensor" else scale, *python_args[2:], FLOAT_CASTS * 3]
    inputs = [t[name] for name in ("heads", "proj_weight", "stream", "norm_weight",
                                   "norm_bias", "up_weight", "up_bias", "down_weight",
                                   "down_bias")]
    return python_args, native_args, inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("row_scale", ["tensor", "float"])
@pytest.mark.parametrize("biases", [False, True])
def test_proj_norm_mlp_node_matches_the_python_function(native, dtype, row_scale, biases):
    python_args, native_args, inputs = _proj_norm_mlp_args(dtype, row_scale, biases)
    python = _run(lambda *a: fused_blocks._projnormmlp_apply(*a, (None, None, None)),
                  python_args, inputs, seed=3)
    _assert_same(_run(native.proj_norm_mlp, native_args, inputs, seed=3), python, dtype)


def test_gradients_only_where_the_inputs_ask(native):
    """Frozen weights get no gradient and the others the same ones, in both forms; so does a
    gradient asked for a subset of the inputs, with an output (the stream) left out."""
    python_args, native_args, inputs = _proj_norm_mlp_args(torch.float64, "tensor", True)
    for frozen in (inputs[1], inputs[5], inputs[8]):  # projection, up weight, down bias
        frozen.requires_grad_(False)
    heads, stream = inputs[0], inputs[2]
    results = []
    for function, args in ((lambda *a: fused_blocks._projnormmlp_apply(*a, (None,) * 3),
                            python_args), (native.proj_norm_mlp, native_args)):
        out, _ = function(*args)
        results.append(torch.autograd.grad(out.square().sum(), [heads, stream]))
        assert all(tensor.grad is None for tensor in inputs)
        out, _ = function(*args)
        out.sum().backward()
        results.append([None if t.grad is None else t.grad.clone() for t in inputs])
        assert inputs[1].grad is None and inputs[5].grad is None and inputs[8].grad is None
        for tensor in inputs:
            tensor.grad = None
    _assert_same(list(results[2]), list(results[0]), torch.float64)
    _assert_same(results[3], results[1], torch.float64)


def test_a_second_backward_recomputes_what_the_first_let_go(native):
    """The MLP's intermediates are freed during the first backward pass (peak memory); with
    retain_graph=True a second pass recomputes them and gives the same gradients."""
    _, native_args, inputs = _proj_norm_mlp_args(torch.float64, "tensor", True)
    out, joined = native.proj_norm_mlp(*native_args)
    loss = out.square().sum() + joined.sum()
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in inputs]
    for tensor in inputs:
        tensor.grad = None
    loss.backward()
    for a, b in zip(first, [t.grad for t in inputs]):
        assert torch.equal(a, b)


def _layer_node_names(model: torch.nn.Module) -> List[str]:
    ids = torch.arange(10).view(2, 5)
    return [name for name in backward_nodes(model(ids, ids))
            if "NormQKV" in name or "ProjNormMLP" in name]


def test_the_switch_turns_the_nodes_off(native, monkeypatch):
    import ipu_unit_scaling as uu

    torch.manual_seed(0)
    model = uu.GPT(vocab_size=16, hidden_size=16, depth=1, heads=2, seq_len=8)
    assert sorted(_layer_node_names(model)) == [
        "torch::autograd::CppNode<(anonymous namespace)::NormQKV>",
        "torch::autograd::CppNode<(anonymous namespace)::ProjNormMLP>"]
    assert native_layers.status().startswith("on: ")
    monkeypatch.setenv(native_layers.OFF_ENV, "0")
    assert native_layers.module() is None
    assert native_layers.status().startswith(f"off ({native_layers.OFF_ENV}=0)")
    assert sorted(_layer_node_names(model)) == ["_NormQKVBackward", "_ProjNormMLPBackward"]


def test_a_failed_build_leaves_the_python_functions(monkeypatch, tmp_path):
    """No compiler (or any build error): the layers keep their Python Functions, the status
    says why, and the build is not tried again in the same process."""
    from torch.utils import cpp_extension

    import ipu_unit_scaling as uu

    calls = []

    def failing_load(**kwargs):
        calls.append(kwargs["build_directory"])
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(native_layers.OFF_ENV, raising=False)
    monkeypatch.setattr(cpp_extension, "load", failing_load)
    monkeypatch.setattr(native_layers, "_loaded", None)
    monkeypatch.setattr(native_layers, "_failure", None)
    assert native_layers.module() is None and native_layers.module() is None
    assert len(calls) == 1 and calls[0].startswith(str(tmp_path))
    assert torch.__version__.replace("+", "-") in calls[0]
    assert native_layers.status() == (
        "unavailable (RuntimeError: Ninja is required to load C++ extensions): the layers "
        "run as Python autograd Functions")
    torch.manual_seed(0)
    model = uu.GPT(vocab_size=16, hidden_size=16, depth=1, heads=2, seq_len=8)
    assert sorted(_layer_node_names(model)) == ["_NormQKVBackward", "_ProjNormMLPBackward"]


_BUILT = b"a library"


def _fake_builds(monkeypatch, tmp_path):
    """native_layers with its source copied under ``tmp_path``, a build that writes a stand-in
    library and a loader that takes only such a file; returns the source and the list of build
    folders built in."""
    from torch.utils import cpp_extension

    source = tmp_path / "src" / "native_layers.cpp"
    source.parent.mkdir()
    source.write_bytes(native_layers.SOURCE.read_bytes())
    for name in native_layers.HEADERS:
        (source.parent / name).write_bytes(native_layers.SOURCE.with_name(name).read_bytes())
    loads: List[str] = []

    def load(**kwargs):
        loads.append(kwargs["build_directory"])
        native_layers._library(Path(kwargs["build_directory"])).write_bytes(_BUILT)
        return object()

    def load_built(library: Path):
        return object() if library.read_bytes() == _BUILT else None

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(native_layers.OFF_ENV, raising=False)
    monkeypatch.setattr(native_layers, "SOURCE", source)
    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(native_layers, "_load_built", load_built)
    return source, loads


def _fresh(monkeypatch):
    monkeypatch.setattr(native_layers, "_loaded", None)
    monkeypatch.setattr(native_layers, "_failure", None)


def test_a_build_killed_midway_does_not_stop_the_next(monkeypatch, tmp_path):
    """A build killed midway leaves torch's own lock file in the build folder; the next build
    clears it rather than wait for it forever, as torch's builder would."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    _, loads = _fake_builds(monkeypatch, tmp_path)
    _fresh(monkeypatch)
    directory = native_layers.build_directory()
    directory.mkdir(parents=True)
    stale = directory / native_layers.TORCH_BUILD_LOCK
    stale.write_bytes(b"")  # what a killed build leaves
    fake_load = cpp_extension.load

    def load(**kwargs):
        baton = FileBaton(str(Path(kwargs["build_directory"]) / native_layers.TORCH_BUILD_LOCK))
        assert baton.try_acquire(), "torch's builder would wait for the stale lock forever"
        baton.release()
        return fake_load(**kwargs)

    monkeypatch.setattr(cpp_extension, "load", load)
    assert native_layers.module() is not None
    assert loads == [str(directory)]
    assert not stale.exists()


def test_the_build_folder_is_keyed_by_what_the_binary_depends_on(monkeypatch, tmp_path):
    source, _ = _fake_builds(monkeypatch, tmp_path)
    first = native_layers.build_directory()
    assert first == native_layers.build_directory()
    seen = {first}
    source.write_bytes(source.read_bytes() + b"\n// changed\n")  # its text
    seen.add(native_layers.build_directory())
    header = source.with_name(native_layers.HEADERS[0])  # its header's text
    header.write_bytes(header.read_bytes() + b"\n// changed\n")
    seen.add(native_layers.build_directory())
    other = tmp_path / "other-checkout" / "native_layers.cpp"  # the same text elsewhere
    other.parent.mkdir()
    other.write_bytes(source.read_bytes())
    other.with_name(header.name).write_bytes(header.read_bytes())
    monkeypatch.setattr(native_layers, "SOURCE", other)
    seen.add(native_layers.build_directory())
    monkeypatch.setattr(native_layers, "_CFLAGS", ["-O3"])  # its flags
    seen.add(native_layers.build_directory())
    # another virtual environment's torch, of the same version
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv" / "torch" / "__init__.py"))
    seen.add(native_layers.build_directory())
    assert len(seen) == 6 and all(torch.__version__.replace("+", "-") in d.name for d in seen)


def test_every_build_is_announced_touched_sources_load_as_built_and_builds_take_turns(
        monkeypatch, tmp_path, capsys):
    import fcntl
    import os
    import threading
    import time

    source, loads = _fake_builds(monkeypatch, tmp_path)
    _fresh(monkeypatch)
    assert native_layers.module() is not None
    assert "building the C++ transformer-layer nodes" in capsys.readouterr().err
    _fresh(monkeypatch)
    assert native_layers.module() is not None and capsys.readouterr().err == ""  # built
    assert len(loads) == 1
    # A checkout or a stash leaves the same sources newer than the library: the folder's key
    # says they are the ones built, so the library loads as it is.
    later = time.time() + 60
    os.utime(source, (later, later))
    _fresh(monkeypatch)
    assert native_layers.module() is not None and capsys.readouterr().err == ""
    assert len(loads) == 1
    # A library that does not load (a build cut short) is built again.
    library = native_layers._library(Path(loads[0]))
    library.write_bytes(b"")
    _fresh(monkeypatch)
    assert native_layers.module() is not None
    assert "building the C++ transformer-layer nodes" in capsys.readouterr().err
    assert len(set(loads)) == 1 and len(loads) == 2
    # Another process holds the folder's lock: with the library built, this one loads it
    # without waiting (a distributed run's ranks); with a build due, it waits, and says so,
    # then loads what the other built, or builds.
    _fresh(monkeypatch)
    with open(Path(loads[0]) / "build.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        loading = threading.Thread(target=native_layers.module)
        loading.start()
        loading.join(timeout=30)
        waited = loading.is_alive()
        fcntl.flock(held, fcntl.LOCK_UN)
        loading.join(timeout=60)
    assert not waited and capsys.readouterr().err == ""
    assert len(loads) == 2
    for other_builds, expected_loads in ((True, 2), (False, 3)):
        library.unlink()
        _fresh(monkeypatch)
        with open(Path(loads[0]) / "build.lock", "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            waiting = threading.Thread(target=native_layers.module)
            waiting.start()
            time.sleep(0.5)
            assert waiting.is_alive()
            if other_builds:
                library.write_bytes(_BUILT)
            fcntl.flock(held, fcntl.LOCK_UN)
            waiting.join(timeout=60)
        assert native_layers._loaded is not None and len(loads) == expected_loads
        err = capsys.readouterr().err
        assert "waiting for another process building" in err
        assert ("building the C++ transformer-layer nodes for" in err) is not other_builds


def test_loading_the_built_nodes_writes_nothing(native):
    """Once built, loading the nodes in a fresh process prints nothing: a run's stderr is the
    user's (torch 2.0's extension builder, imported in a CUDA build of torch without a GPU,
    prints about CUDA)."""
    import subprocess
    import sys

    code = ("from ipu_unit_scaling.ops import native_layers\n"
            "assert native_layers.module() is not None, native_layers.status()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done


# ---- FP8 linears: the nodes make each linear's casts by calling the host library's kernels.

_RECIPES = ["static", "amax", "delayed", "rowwise", "rowwise_with_gw_hp", "block", "mx",
            "mx_round_up", "mxfp4", "nvfp4"]
_FP8_NODES = ("torch::autograd::CppNode<(anonymous namespace)::NormQKV>",
              "torch::autograd::CppNode<(anonymous namespace)::ProjNormMLP>")
_LINEAR_NODE = "torch::autograd::CppNode<(anonymous namespace)::Fp8Linear>"


def _fp8_gpt(recipe: str):
    import ipu_unit_scaling as uu
    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.transforms import simulate_fp8

    torch.manual_seed(0)
    model = uu.GPT(vocab_size=48, hidden_size=32, depth=2, heads=4, seq_len=12)
    return simulate_fp8(model, FP8Config().with_recipe(recipe))


def _two_steps(model: torch.nn.Module, ids: torch.Tensor) -> List[torch.Tensor]:
    """Losses and gradients of two training steps (SGD between them, so that the second
    casts other weights), the second backward pass run twice (retain_graph)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    got: List[torch.Tensor] = []
    for step in range(2):
        optimizer.zero_grad()
        loss = model(ids, ids)
        loss.backward(retain_graph=step == 1)
        got += [loss.detach()] + [p.grad.clone() for p in model.parameters()]
        if step == 1:
            optimizer.zero_grad()
            loss.backward()
            got += [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return got


def _count_fallbacks(request) -> List[int]:
    """The casts the nodes hand back to the Python quantisers from now on (to those
    registered so far), by their index; restored at the test's end."""
    from ipu_unit_scaling.fp8 import native_casts

    calls: List[int] = []
    fallbacks = native_casts._fallbacks
    original = list(fallbacks)
    request.addfinalizer(lambda: fallbacks.__setitem__(slice(0, len(original)), original))
    for index, cast in enumerate(original):
        def counted(x, transposed, out, cast=cast, index=index):
            calls.append(index)
            return cast(x, transposed, out)

        fallbacks[index] = counted
    return calls


@pytest.mark.parametrize("recipe", _RECIPES)
def test_fp8_layers_run_as_nodes_with_the_python_functions_values(native, monkeypatch, request,
                                                                   recipe):
    """An FP8 GPT's layers and its readout run as the FP8 nodes, with the Python Functions'
    losses and gradients bit for bit, over two steps and a second backward pass: both forms
    call the same cast kernels and GEMMs with the same arguments in the same order (where a
    cast is not a kernel's, as a square weight block, the node calls the Python one). The
    delayed recipe's amax histories end equal too."""
    import copy

    model = _fp8_gpt(recipe)
    python_model = copy.deepcopy(model)
    ids = torch.randint(0, 48, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # (no amax enters a history outside training)
        names = backward_nodes(model(ids, ids).detach().requires_grad_())
    names = backward_nodes(model(ids, ids))
    assert [names.count(node) for node in _FP8_NODES] == [2, 2]
    assert names.count(_LINEAR_NODE) == 1  # the readout
    handed_back = _count_fallbacks(request)
    nodes = _two_steps(model, ids)
    # (every cast by the nodes' own kernel calls, NVFP4's included, but the float32 operands
    # of rowwise_with_gw_hp's weight-gradient GEMM, which they hand back)
    assert bool(handed_back) == (recipe == "rowwise_with_gw_hp")
    monkeypatch.setattr(native_layers, "module", lambda: None)
    names = backward_nodes(python_model(ids, ids))
    assert names.count("_NormQKVBackward") == 2 and not any("CppNode" in n for n in names)
    python = _two_steps(python_model, ids)
    assert len(nodes) == len(python)
    for index, (a, b) in enumerate(zip(nodes, python)):
        assert torch.equal(a, b), index
    histories = [(name, buffer) for name, buffer in model.named_buffers()
                 if name.endswith("amax_history")]
    assert len(histories) == (9 if recipe == "delayed" else 0)
    python_buffers = dict(python_model.named_buffers())
    for name, history in histories:
        assert history[:, 0].gt(0).all() and torch.equal(history, python_buffers[name]), name


@pytest.mark.parametrize("recipe", ["static", "mx"])
@pytest.mark.parametrize("float_linear", [0, 1, 2])
def test_fp8_node_with_a_float_linear_matches_the_python_function(native, recipe,
                                                                  float_linear):
    """`proj_norm_mlp` with one of its three linears float (its casts empty), frozen
    weights among the inputs, against the Python Function with the same quantisers."""
    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.fp8.linear import ValuesQuantiser

    config = FP8Config().with_recipe(recipe)
    quantisers = [ValuesQuantiser(config, site) for site in ("p", "u", "d")]
    quantisers[float_linear] = None  # type: ignore[call-overload]
    casts = native_layers.node_casts(quantisers)
    assert casts is not None and len(casts) == 9
    assert [len(c) == 0 for c in casts[3 * float_linear:3 * float_linear + 3]] == [True] * 3
    for row_scale in ("tensor", "float"):
        python_args, native_args, inputs = _proj_norm_mlp_args(torch.float32, row_scale, True,
                                                               seq=8)
        inputs[3].requires_grad_(False)  # the norm's weight
        python = _run(lambda *a: fused_blocks._projnormmlp_apply(*a, tuple(quantisers)),
                      python_args, inputs, seed=3)
        nodes = _run(lambda *a: native.proj_norm_mlp(*a[:-1], casts), native_args, inputs,
                     seed=3)
        assert python[5] is None and nodes[5] is None
        for index, (a, b) in enumerate(zip(nodes, python)):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), index


@pytest.mark.parametrize("recipe", ["amax", "mx", "block"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_fp8_nodes_refuse_a_non_finite_cast_as_the_python_functions_do(native, monkeypatch,
                                                                        recipe, where):
    """A NaN that reaches a cast (a weight in the forward pass, the loss's gradient in the
    backward) raises the Python Functions' NonFiniteAmaxError, with their message: the
    node hands the refused operand to the Python quantiser."""
    from ipu_unit_scaling.fp8 import NonFiniteAmaxError

    messages = []
    for form in ("nodes", "python"):
        if form == "python":
            monkeypatch.setattr(native_layers, "module", lambda: None)
        model = _fp8_gpt(recipe)
        ids = torch.randint(0, 48, (3, 11), generator=torch.Generator().manual_seed(1))
        if where == "forward":
            with torch.no_grad():
                model.layers[1].mlp.up.weight[0, 0] = float("nan")
        with pytest.raises(NonFiniteAmaxError) as error:
            loss = model(ids, ids)
            names = backward_nodes(loss)
            assert (_FP8_NODES[0] in names) == (form == "nodes")
            loss.backward(torch.tensor(float("nan")))
        messages.append(str(error.value))
    assert messages[0] == messages[1] and "nan" in messages[0]


def test_observed_fp8_casts_take_the_python_functions(native):
    """Where the casts are recorded (`fp8_stats`), the layers keep their Python Functions,
    whose casts the statistics see; outside it the nodes return."""
    from ipu_unit_scaling.fp8 import fp8_stats

    model = _fp8_gpt("mx")
    ids = torch.randint(0, 48, (3, 11), generator=torch.Generator().manual_seed(1))
    with fp8_stats() as stats:
        names = backward_nodes(model(ids, ids))
    assert names.count("_NormQKVBackward") == 2 and not any("CppNode" in n for n in names)
    assert len(stats.records) > 0
    assert backward_nodes(model(ids, ids)).count(_FP8_NODES[1]) == 2


@pytest.mark.parametrize("recipe", ["static", "mx"])
def test_fp8_nodes_reuse_no_buffer_a_pending_backward_still_holds(native, monkeypatch,
                                                                   recipe):
    """The nodes keep their casts' buffers between calls (`pooled` in native_layers.cpp), the
    ones saved for the backward pass too: two forward passes before either backward pass
    (two micro-batches) must not share one, so their gradients are the Python Functions'."""
    import copy

    model = _fp8_gpt(recipe)
    python_model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 48, (3, 11), generator=generator) for _ in range(2)]

    def accumulate(gpt: torch.nn.Module) -> List[torch.Tensor]:
        losses = [gpt(ids, ids) for ids in batches]
        grads = []
        for loss in losses:
            loss.backward()
            grads += [p.grad.clone() for p in gpt.parameters()]
        return [loss.detach() for loss in losses] + grads

    nodes = accumulate(model)
    monkeypatch.setattr(native_layers, "module", lambda: None)
    python = accumulate(python_model)
    for index, (a, b) in enumerate(zip(nodes, python)):
        assert torch.equal(a, b), index


def test_fp8_nodes_keep_one_step_of_buffers_and_let_other_shapes_go(native):
    """The nodes' kept buffers (per thread: this runs in a thread of its own, whose CPU
    backward passes run in it too): a second step of the same shapes makes none (each layer's
    saved casts reuse the ones the previous backward pass let go), and a run of other sequence
    lengths leaves the buffers of the last one only, as many as its step held. (AMAX: the
    static recipe casts its inputs over their temporaries, in no kept buffer.)"""
    import threading

    model = _fp8_gpt("amax")
    generator = torch.Generator().manual_seed(1)
    kept: List[list] = []

    def step(length: int) -> None:
        ids = torch.randint(0, 48, (3, length), generator=generator)
        model(ids, ids).backward()
        kept.append(sorted(native.kept_buffers()))

    def run() -> None:
        for length in (11, 11, 10, 9, 8, 7):
            step(length)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(kept) == 6
    first = kept[0]
    assert kept[1] == first
    # (two layers: each saved cast of a slot has two buffers)
    slots: Dict[str, int] = {}
    for slot, _ in first:
        slots[slot] = slots.get(slot, 0) + 1
    assert slots["qkv.input"] == 2 and slots["up.weight"] == 2
    last = kept[-1]
    assert len(last) == len(first) and {s for s, _ in last} == set(slots)
    # (the rows of an input cast: batch 3 times the last length, 7; width 32)
    assert [n for s, n in last if s == "qkv.input"] == [3 * 7 * 32] * 2
    assert [n for s, n in last if s == "up.weight"] == [n for s, n in first if s == "up.weight"]


@pytest.mark.parametrize("recipe", ["static", "delayed"])
def test_casts_with_a_known_scale_overwrite_their_temporaries_and_keep_no_input_buffer(
        native, recipe):
    """Under the static and delayed recipes an input cast writes its values over the
    temporary it casts (the norm's output, the joined heads, the GELU's output), which
    nothing reads afterwards: no input slot is kept, while the weights' casts are."""
    import threading

    model = _fp8_gpt(recipe)
    kept: List[list] = []

    def run() -> None:
        ids = torch.randint(0, 48, (3, 11), generator=torch.Generator().manual_seed(3))
        model(ids, ids).backward()
        kept.extend(native.kept_buffers())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    slots = {slot for slot, _ in kept}
    assert {"qkv.weight", "up.weight", "down.weight"} <= slots, slots
    assert not slots & {"qkv.input", "proj.input", "up.input", "down.input"}, slots


@pytest.mark.parametrize("recipe", ["static", "delayed"])
def test_casts_with_a_known_scale_overwrite_the_gelus_gradient_and_keep_no_up_grad_buffer(
        native, recipe):
    """Under the static and delayed recipes the up linear's gradient cast writes its values
    over the GELU's gradient, the node's own temporary (its bias gradient summed first): no
    "up.grad" slot is kept, while the down linear's cast of the incoming gradient, which
    autograd may hand to other nodes too, keeps its buffer. Values, gradients (the biases'
    included) and amax histories stay the Python Function's, bit for bit."""
    import threading

    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.fp8.linear import ValuesQuantiser
    from ipu_unit_scaling.fp8.recipe_linear import new_amax_history

    config = FP8Config().with_recipe(recipe)

    def quantisers() -> tuple:
        def history() -> Optional[torch.Tensor]:
            return (new_amax_history(config).add_(3.0) if recipe == "delayed" else None)

        return tuple(ValuesQuantiser(config, site, history(), update=recipe == "delayed")
                     for site in ("p", "u", "d"))

    python_quantisers, node_quantisers = quantisers(), quantisers()
    casts = native_layers.node_casts(node_quantisers)
    assert casts is not None
    python_args, native_args, inputs = _proj_norm_mlp_args(torch.float32, "tensor", True,
                                                           seq=8)
    python = _run(lambda *a: fused_blocks._projnormmlp_apply(*a, python_quantisers),
                  python_args, inputs, seed=3)
    nodes: list = []
    kept: List[tuple] = []

    def run() -> None:  # (a thread of its own: its kept buffers are this step's only)
        nodes.extend(_run(lambda *a: native.proj_norm_mlp(*a[:-1], casts), native_args,
                          inputs, seed=3))
        kept.extend(native.kept_buffers())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(nodes) == len(python) and python[8] is not None  # (the up bias's gradient)
    for index, (a, b) in enumerate(zip(nodes, python)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), index
    for a, b in zip(node_quantisers, python_quantisers):
        assert (a.history is None) == (b.history is None)
        assert a.history is None or torch.equal(a.history, b.history)
    slots = {slot for slot, _ in kept}
    assert "down.grad" in slots and "up.grad" not in slots, slots


def test_fp8_nodes_make_casts_over_2_to_the_20_elements_afresh(native):
    """A cast of more than 2^20 elements (4 MiB) is not kept between steps: here the MLP's
    activations, 8,400 tokens of width 128, are over the bound, and its input, width 32, is
    under it (AMAX, whose input casts go to kept buffers)."""
    import threading

    model = _fp8_gpt("amax")
    kept: List[list] = []

    def run() -> None:
        ids = torch.randint(0, 48, (700, 12), generator=torch.Generator().manual_seed(2))
        model(ids, ids).backward()
        kept.extend(native.kept_buffers())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    sizes = {slot: n for slot, n in kept}
    assert sizes["qkv.input"] == 700 * 12 * 32
    assert sizes["up.input"] == 700 * 12 * 32
    assert "down.input" not in sizes
    assert max(sizes.values()) <= 1 << 20
