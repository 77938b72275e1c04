"""The FP8 linear as one C++ node (`fp8.linear.native_linear`) against the Python Functions it
stands for (`_FP8ValuesLinear`, `recipe_linear._RecipeLinear`), and the delayed recipe's casts
in the layers' Functions against those of its per-linear Function."""
from __future__ import annotations

import copy
from typing import List

import pytest
import torch
from helpers import backward_nodes, built_native_layers

from ipu_unit_scaling.fp8 import FP8Config, FP8Linear
from ipu_unit_scaling.fp8.linear import FP8UnitScaledLinear
from ipu_unit_scaling.ops import native_layers

pytestmark = pytest.mark.usefixtures("one_thread")

_NODE = "torch::autograd::CppNode<(anonymous namespace)::Fp8Linear>"
_RECIPES = ["static", "amax", "delayed", "rowwise", "rowwise_with_gw_hp", "block", "mx",
            "mxfp4", "nvfp4"]


@pytest.fixture(scope="module")
def native():
    return built_native_layers()


def _steps(layer: torch.nn.Module, x: torch.Tensor, frozen: str) -> List[torch.Tensor]:
    """Outputs and gradients of two forward and backward passes (the second with another
    weight), ``frozen`` ("x", "weight" or "") taking no gradient."""
    x = x.detach().clone().requires_grad_(frozen != "x")
    layer.weight.requires_grad_(frozen != "weight")
    generator = torch.Generator().manual_seed(2)
    got: List[torch.Tensor] = []
    for _ in range(2):
        for p in (x, *layer.parameters()):
            p.grad = None
        y = layer(x)
        y.backward(torch.randn(y.shape, generator=generator))
        got += [y.detach()] + [t.grad.clone() for t in (x, *layer.parameters())
                               if t.grad is not None]
        with torch.no_grad():
            layer.weight.mul_(-1.5)
    return got


@pytest.mark.parametrize("recipe", _RECIPES)
@pytest.mark.parametrize("kind", ["plain, bias", "unit-scaled readout"])
@pytest.mark.parametrize("frozen", ["", "x", "weight"])
def test_the_fp8_linear_node_gives_the_python_functions_values(native, monkeypatch, recipe,
                                                               kind, frozen):
    """Both forms call the same cast kernels (or the same Python cast, where no kernel makes
    it) and the same GEMMs with the same arguments in the same order: equal bit for bit,
    the delayed recipe's amax history too."""
    config = FP8Config().with_recipe(recipe)
    torch.manual_seed(0)
    if kind == "plain, bias":
        layer = FP8Linear(64, 48, bias=True, config=config, site="plain")
    else:
        import ipu_unit_scaling as uu

        layer = FP8UnitScaledLinear.from_unit_scaled(uu.LinearReadout(64, 48), config, "head")
    python_layer = copy.deepcopy(layer)
    x = torch.randn(3, 32, 64) * 4
    with torch.no_grad():
        assert layer(x).grad_fn is None
    assert _NODE in backward_nodes(layer(x))
    nodes = _steps(layer, x, frozen)
    monkeypatch.setattr(native_layers, "module", lambda: None)
    names = backward_nodes(python_layer(x))
    assert _NODE not in names and any(n.endswith("LinearBackward") for n in names)
    python = _steps(python_layer, x, frozen)
    assert len(nodes) == len(python)
    for index, (a, b) in enumerate(zip(nodes, python)):
        assert torch.equal(a, b), index
    for (name, a), b in zip(layer.named_buffers(), python_layer.buffers()):
        assert a[:, 0].gt(0).all() and torch.equal(a, b), name


def test_a_non_finite_operand_raises_the_python_functions_error(native):
    """A NaN in the delayed recipe's operand reaches the Python cast, whose error it raises,
    and enters no history."""
    from ipu_unit_scaling.fp8 import NonFiniteAmaxError

    layer = FP8Linear(16, 8, config=FP8Config().with_recipe("delayed"))
    x = torch.randn(4, 16)
    layer(x)
    history = layer.amax_history.clone()
    x[1, 2] = float("nan")
    with pytest.raises(NonFiniteAmaxError, match="nan"):
        layer(x)
    assert torch.equal(layer.amax_history, history)


def test_delayed_layers_cast_as_the_per_linear_function(monkeypatch):
    """The delayed recipe's two-Function layer casts each GEMM operand with the scale its
    per-linear Function (`recipe_linear`) would use, read from the same history: the same
    sites in the same order, with the same scales, on tensors equal to float32 rounding (the
    two forms order the norms' and joins' float32 operations differently)."""
    import ipu_unit_scaling as uu
    from ipu_unit_scaling.fp8 import linear, recipe_linear
    from ipu_unit_scaling.modules import gpt_blocks
    from ipu_unit_scaling.transforms import simulate_fp8

    torch.manual_seed(0)
    model = simulate_fp8(uu.GPT(vocab_size=48, hidden_size=32, depth=2, heads=4, seq_len=12),
                         FP8Config().with_recipe("delayed"))
    ids = torch.randint(0, 48, (3, 11))
    monkeypatch.setattr(native_layers, "module", lambda: None)
    seen: list = []
    role_cast = recipe_linear.role_cast

    def record(t, config, role, site, log2_scale=None):
        seen.append((site, log2_scale, t.detach().clone()))
        return role_cast(t, config, role, site, log2_scale)

    monkeypatch.setattr(recipe_linear, "role_cast", record)
    monkeypatch.setattr(linear, "role_cast", record)
    five_model = copy.deepcopy(model)
    for _ in range(2):
        model(ids, ids).backward()
    assert backward_nodes(model(ids, ids)).count("_NormQKVBackward") == 2
    two, seen[:] = list(seen), []
    monkeypatch.setattr(gpt_blocks.TransformerBlock, "_two_function_form",
                        lambda self, x: None)
    for _ in range(2):
        five_model(ids, ids).backward()
    five_model(ids, ids)
    # (by site: the two forms cast a layer's down weight and input in either order)
    by_site = [{site: [(c, t) for s, c, t in casts if s == site] for site, _, _ in casts}
               for casts in (two, seen)]
    assert sorted(by_site[0]) == sorted(by_site[1]) and len(by_site[0]) == 3 * (2 * 4 + 1)
    for site, casts in by_site[1].items():
        assert [c for c, _ in by_site[0][site]] == [c for c, _ in casts], site
        for (_, got), (_, want) in zip(by_site[0][site], casts):
            torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5,
                                       atol=1e-5 * want.abs().max().item(), msg=site)
