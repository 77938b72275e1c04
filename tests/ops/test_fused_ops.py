"""The eager forms (one autograd Function per op) against the scale() composition they replace.

The composition is built here from `scale` / `scale_bwd` exactly as the ops were before the
fusion. Values and gradients agree to float32 rounding (a scale inside a GEMM rounds
differently); layer norm and embedding, whose scales stay where they were, agree bit for bit.
"""
from __future__ import annotations

import math
from typing import Callable, List, Sequence

import pytest
import torch
import torch.nn.functional as F
from helpers import backward_nodes, built_native_layers

import ipu_unit_scaling.functional as U
from ipu_unit_scaling.ops import attention_ops, fused_blocks, native_layers
from ipu_unit_scaling.ops import fused_ops as fused
from ipu_unit_scaling.scale import scale, scale_bwd, scale_fwd

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics


def run(fn: Callable, inputs: Sequence[torch.Tensor], seed: int = 0):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                       dtype=out.dtype)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def assert_match(a, b, rtol: float = 2e-6, exact: bool = False) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    pairs: List = [(out_a, out_b)] + list(zip(grads_a, grads_b))
    for x, y in pairs:
        assert (x is None) == (y is None)
        if x is None:
            continue
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=rtol, atol=rtol * y.abs().max().item())


def composed_linear(x, w, b, scales):
    output_scale, grad_input_scale, grad_weight_scale = scales
    w = scale(w, output_scale, grad_weight_scale)
    x = scale_bwd(x, grad_input_scale / output_scale)
    b = None if b is None else scale(b, output_scale, grad_weight_scale)
    return F.linear(x, w, b)


def randn(*shape, seed=1, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("x_shape", [(6, 8), (2, 3, 8), (2, 1, 3, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_the_composition(x_shape, bias):
    scales = (0.3, 0.7, 0.11)
    inputs = [randn(*x_shape), randn(5, 8, seed=2)] + ([randn(5, seed=3)] if bias else [])

    def fused_fn(x, w, *b):
        return fused.linear(x, w, b[0] if b else None, *scales)

    def composed_fn(x, w, *b):
        return composed_linear(x, w, b[0] if b else None, scales)

    assert_match(run(fused_fn, inputs), run(composed_fn, inputs))


def test_linear_on_a_transposed_input_and_float64():
    x = randn(8, 6).t()  # not contiguous
    w = randn(5, 8, seed=2)
    assert_match(run(lambda x, w: fused.linear(x, w, None, 0.3, 0.7, 0.11), [x, w]),
                 run(lambda x, w: composed_linear(x, w, None, (0.3, 0.7, 0.11)), [x, w]))
    x64, w64 = randn(4, 8, dtype=torch.float64), randn(5, 8, seed=2, dtype=torch.float64)
    assert_match(run(lambda x, w: fused.linear(x, w, None, 0.3, 0.7, 0.11), [x64, w64]),
                 run(lambda x, w: composed_linear(x, w, None, (0.3, 0.7, 0.11)), [x64, w64]),
                 rtol=1e-12)


def test_linear_gradients_only_where_asked_and_none_without_grad():
    x, w = randn(4, 8), randn(5, 8, seed=2).requires_grad_()
    out = fused.linear(x, w, None, 0.3, 0.7, 0.11)
    out.sum().backward()
    assert x.grad is None and w.grad is not None
    with torch.no_grad():
        plain = fused.linear(x, w, None, 0.3, 0.7, 0.11)
    assert plain.grad_fn is None
    torch.testing.assert_close(plain, out.detach())
    vector = fused.linear(randn(8), w, None, 0.3, 0.7, 0.11)  # 1-D input, as F.linear takes
    assert vector.shape == (5,)


@pytest.mark.parametrize("left, right", [((6, 8), (8, 5)), ((3, 6, 8), (3, 8, 5)),
                                         ((2, 3, 6, 8), (8, 5)), ((3, 6, 8), (1, 8, 5))])
def test_matmul_matches_the_composition(left, right):
    scales = (0.3, 0.5, 0.9)

    def composed(a, b):
        out = torch.matmul(scale_bwd(a, scales[1] / scales[0]), scale_bwd(b, scales[2] / scales[0]))
        return out * scales[0]

    inputs = [randn(*left), randn(*right, seed=2)]
    assert_match(run(lambda a, b: fused.matmul(a, b, *scales), inputs), run(composed, inputs))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_the_composition(approximate):
    def composed(x):
        return F.gelu(scale_bwd(x, 1.3 / 1.7), approximate=approximate) * 1.7

    inputs = [randn(4, 16)]
    assert_match(run(lambda x: fused.gelu(x, approximate, 1.7, 1.3), inputs),
                 run(composed, inputs))


@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_layer_norm_is_torch_bit_for_bit(affine):
    weight = None if affine == "none" else randn(16, seed=2) + 1
    bias = randn(16, seed=3) if affine == "both" else None
    params = [t for t in (weight, bias) if t is not None]

    def eager(x, *p):
        return fused.layer_norm(x, (16,), *_affine(p, weight, bias), 1e-5, 0.25)

    def composed(x, *p):
        w, b = _affine(p, weight, bias)
        w = None if w is None else scale_bwd(w, 0.25)
        b = None if b is None else scale_bwd(b, 0.25)
        return F.layer_norm(x, (16,), w, b, 1e-5)

    inputs = [randn(3, 5, 16)] + params
    assert_match(run(eager, inputs), run(composed, inputs), exact=True)


def _affine(params, weight, bias):
    params = list(params)
    w = params.pop(0) if weight is not None else None
    b = params.pop(0) if bias is not None else None
    return w, b


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_is_torch_bit_for_bit(padding_idx):
    ids = torch.randint(0, 10, (4, 7), generator=torch.Generator().manual_seed(0))
    weight = randn(10, 8)
    eager = run(lambda w: fused.embedding(ids, w, padding_idx, 0.4), [weight])
    composed = run(lambda w: F.embedding(ids, scale_bwd(w, 0.4), padding_idx), [weight])
    assert_match(eager, composed, exact=True)


def composed_residual(x, w, tau):
    a, b = tau / math.sqrt(1 + tau**2), 1 / math.sqrt(1 + tau**2)
    branch, skip = scale_bwd(x, a), x
    return skip * b + scale_fwd(F.linear(branch, w), a)


def test_residual_split_and_add_match_the_composition():
    tau = 0.3

    def eager(x, w):
        branch, skip = U.residual_split(x, tau)
        return U.residual_add(F.linear(branch, w), skip, tau)

    inputs = [randn(4, 8), randn(8, 8, seed=2)]
    assert_match(run(eager, inputs), run(lambda x, w: composed_residual(x, w, tau), inputs))


def test_residual_split_with_an_unused_side():
    x = randn(4, 8).requires_grad_()
    branch, skip = U.residual_split(x, 0.5)
    (branch * 2).sum().backward()  # skip unused: the branch gradient, scaled
    a = 0.5 / math.sqrt(1.25)
    torch.testing.assert_close(x.grad, torch.full_like(x, 2 * a))
    x.grad = None
    branch, skip = U.residual_split(x, 0.5)
    (skip * 3).sum().backward()  # branch unused: the skip gradient, scaled
    torch.testing.assert_close(x.grad, torch.full_like(x, 3 / math.sqrt(1.25)))


def test_residual_add_with_broadcast_or_mixed_dtypes_takes_the_composition():
    residual, skip = randn(4, 8).requires_grad_(), randn(8).requires_grad_()
    out = U.residual_add(residual, skip, 0.5)
    assert out.shape == (4, 8)
    out.sum().backward()
    # The skip's weight is a forward one (residual_split applies it to the gradient).
    torch.testing.assert_close(skip.grad, torch.full((8,), 4.0))


def test_attention_row_scale_is_cached_per_shape_and_matches_the_uncached_one():
    q = randn(2, 3, 6, 4)
    causal = U.scaled_dot_product_attention(q, q, q, is_causal=True, scale=0.5)
    again = U.scaled_dot_product_attention(q, q, q, is_causal=True, scale=0.5)
    assert torch.equal(causal, again)
    row = attention_ops._row_scale(6, 6, None, True, 1.0, 0.0, torch.float32, q.device)
    expected = F.scaled_dot_product_attention(q, q, q, is_causal=True) * row
    assert torch.equal(causal, expected)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_modules_match_the_op_by_op_forms(monkeypatch, bias, layer_form):
    """uu.GPT, TransformerLayer and MLP with their one-Function eager forms
    against the same model computed op by op (the forms switched off)."""
    import ipu_unit_scaling as uu
    from ipu_unit_scaling.modules import gpt_blocks as modules

    torch.manual_seed(0)
    model = uu.GPT(vocab_size=48, hidden_size=32, depth=2, heads=4, seq_len=12,
                                  bias=bias)
    with torch.no_grad():  # (trained biases: they start at zero, where every rule agrees)
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_()
    ids = torch.randint(0, 48, (3, 11))
    labels = torch.randint(0, 48, (3, 11))

    def loss_and_grads():
        model.zero_grad()
        loss = model(ids, labels)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    fused_loss, fused_grads = loss_and_grads()
    for cls, name in [(modules.TransformerBlock, "_fusable"), (modules.FeedForward, "_fusable"),
                      (uu.GPT, "_fusable_embed")]:
        monkeypatch.setattr(cls, name, lambda self, x: False)
    loss, grads = loss_and_grads()
    torch.testing.assert_close(fused_loss, loss, rtol=1e-6, atol=0)
    for got, want in zip(fused_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("row_scale", ["tensor", "float"])
def test_linear_with_a_row_scale_is_the_linear_times_it_bit_for_bit(row_scale):
    """The attention row scale folded into the output projection's node: the same products
    as a multiply after it, in both passes."""
    scale = attention_ops._row_scale(6, 6, None, True, 1.0, 0.0, torch.float32,
                                     torch.device("cpu")) if row_scale == "tensor" else 3.5
    results = []
    for folded in (True, False):
        x = randn(2, 6, 8).requires_grad_()
        w = randn(5, 8, seed=1).requires_grad_()
        if folded:
            out = fused.linear(x, w, None, 0.3, 0.7, 0.2, scale)
        else:
            out = fused.linear(x, w, None, 0.3, 0.7, 0.2) * scale
        out.backward(randn(2, 6, 5, seed=2))
        results.append([out.detach(), x.grad, w.grad])
    # The same kernels in the same order; only MKL, whose GEMM blocking may follow the buffers'
    # alignment, could round an 8-term dot product differently: at most 8 float32 unit
    # roundoffs (2**-24 each) relative, 1e-6 with room for the scale products.
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def test_gpt_joins_each_layer_into_the_next_norm_bit_for_bit(monkeypatch, layer_form):
    """uu.GPT leaves each layer's last residual join to the next layer's first norm (the final
    norm's for the last): the same values and gradients as the layers one by one."""
    import ipu_unit_scaling as uu

    torch.manual_seed(0)
    model = uu.GPT(vocab_size=48, hidden_size=32, depth=3, heads=4, seq_len=12)
    ids = torch.randint(0, 48, (3, 11))
    assert model._fusable_stack(model.embed(ids))
    results = []
    for stacked in (True, False):
        if not stacked:
            monkeypatch.setattr(uu.GPT, "_fusable_stack", lambda self, x: False)
        model.zero_grad()
        loss = model(ids, ids)
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    # The same kernels in the same order (bit for bit here); MKL's alignment-dependent GEMM
    # blocking could still reorder <= 128-term sums (128 * 2**-24 = 7.6e-6 relative), which a
    # few ops carry to a gradient: 1e-5, far below a join weight gone wrong (tau 0.5: 30%).
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    monkeypatch.undo()
    handle = model.layers[1].register_forward_hook(lambda module, args, out: None)
    assert not model._fusable_stack(model.embed(ids))  # a hooked layer sees its own output
    handle.remove()


def test_hooks_turn_the_fused_forms_off():
    import ipu_unit_scaling as uu

    torch.manual_seed(0)
    layer = uu.TransformerBlock(16, 2)
    x = randn(2, 5, 16)
    assert layer._fusable(x) and layer.mlp._fusable(x)
    handle = layer.mlp.up.register_forward_hook(lambda module, args, out: None)
    assert not layer.mlp._fusable(x)
    handle.remove()
    handle = layer.attn_norm.register_forward_hook(lambda module, args, out: None)
    assert not layer._fusable(x)
    handle.remove()


def test_fused_mlp_backward_twice_with_retain_graph():
    """The fused MLP drops its intermediates during backward (peak memory); a second backward
    through the same graph recomputes them and gives the same gradients."""
    import ipu_unit_scaling as uu

    torch.manual_seed(0)
    mlp = uu.FeedForward(16, bias=True)
    x = randn(2, 5, 16).requires_grad_()
    assert mlp._fusable(x)
    out = mlp(x)
    grad = randn(2, 5, 16, seed=4)
    out.backward(grad, retain_graph=True)
    first = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad()
    out.backward(grad)
    second = [x.grad] + [p.grad for p in mlp.parameters()]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _layer_nodes(names: List[str], function: str) -> int:
    """How many of ``names`` are the layer Function ``function`` (NormQKV, ProjNormMLP), as a
    Python Function or as its C++ node."""
    return sum(name in (f"_{function}Backward", f"torch::autograd::CppNode<(anonymous "
                                                  f"namespace)::{function}>") for name in names)


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(ids, ids)
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_layer_runs_as_two_functions_with_the_five_function_values(monkeypatch, dtype,
                                                                        layer_form):
    """uu.GPT's layers take two Functions around torch's attention kernel (the QKV projection
    in the first norm's, the output projection, the MLP and its norm in the second), with the
    values and gradients of the five Functions they replace."""
    import ipu_unit_scaling as uu
    from ipu_unit_scaling.modules import gpt_blocks as modules

    torch.manual_seed(0)
    depth = 3
    model = uu.GPT(vocab_size=48, hidden_size=32, depth=depth, heads=4, seq_len=12).to(dtype)
    ids = torch.randint(0, 48, (3, 11))
    names = backward_nodes(model(ids, ids))
    assert _layer_nodes(names, "NormQKV") == depth
    assert _layer_nodes(names, "ProjNormMLP") == depth
    assert any(name.startswith("torch::autograd::CppNode") for name in names) == (
        layer_form == "native")
    assert "_MLPBackward" not in names and "_LinearBackward" in names  # (the readout's)
    two = _loss_and_grads(model, ids)
    monkeypatch.setattr(modules.TransformerBlock, "_two_function_form", lambda self, x: None)
    assert "_MLPBackward" in backward_nodes(model(ids, ids))
    five = _loss_and_grads(model, ids)
    # The join weights move into the GEMMs' alphas, so each join, norm and GEMM may round
    # once differently: a few unit roundoffs (float32 2**-24, float64 2**-53) carried through
    # <= 128-term sums and the ops of three layers: 1e-5 (float32) and 1e-13 (float64)
    # relative, far below a weight applied twice or lost (tau 0.2: 18% and more).
    rtol = 1e-5 if dtype == torch.float32 else 1e-13
    for got, want in zip(two, five):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())


def test_a_block_alone_in_two_functions_matches_its_ops_one_by_one(monkeypatch, layer_form):
    """A TransformerBlock outside a GPT (its own last join, unit scaling's residual add)."""
    import ipu_unit_scaling as uu
    from ipu_unit_scaling.modules import gpt_blocks as modules

    torch.manual_seed(0)
    block = uu.TransformerBlock(16, 2).double()
    x = randn(2, 5, 16).double()
    assert block._two_function_form(x) is not None
    results = []
    for fused_form in (True, False):
        if not fused_form:
            monkeypatch.setattr(modules.TransformerBlock, "_fusable", lambda self, x: False)
        results.append(run(block, [x], seed=3) + ([p.grad.clone() for p in block.parameters()],))
        block.zero_grad()
    # float64 throughout: a few 2**-53 roundings through 64-term sums, 1e-13 relative.
    (out_a, grads_a, params_a), (out_b, grads_b, params_b) = results
    for got, want in zip([out_a, *grads_a, *params_a], [out_b, *grads_b, *params_b]):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13 * want.abs().max().item())


def test_the_two_function_form_gives_way_where_its_parts_differ():
    """Dropout between the parts (training), a hooked projection, unit-scaling's rules or a
    masked attention: the layer keeps its op-by-op or five-Function form."""
    import ipu_unit_scaling as uu

    torch.manual_seed(0)
    x = randn(2, 5, 16)
    block = uu.TransformerBlock(16, 2, dropout_p=0.1)
    assert block._two_function_form(x) is None
    block.eval()
    assert block._two_function_form(x) is not None
    handle = block.attn.proj.register_forward_hook(lambda module, args, out: None)
    assert block._two_function_form(x) is None
    handle.remove()
    with uu.rules("unit-scaling"):
        assert block._two_function_form(x) is None
    assert uu.TransformerBlock(16, 2, bias=True)._two_function_form(x) is None


@pytest.mark.parametrize("recipe", [None, "static", "mx", "block"])
def test_two_function_backward_twice_with_retain_graph(layer_form, recipe):
    """The second Function drops the MLP's intermediates in its backward pass (peak memory);
    a second backward recomputes them and gives the same gradients, bit for bit. Under a
    grouped recipe (whose forward GEMMs' casts are not kept) it casts the MLP's forward
    operands again from the norm's output."""
    import ipu_unit_scaling as uu
    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.transforms import simulate_fp8

    torch.manual_seed(0)
    model = uu.GPT(vocab_size=48, hidden_size=64, depth=2, heads=4, seq_len=12)
    if recipe is not None:
        simulate_fp8(model, FP8Config().with_recipe(recipe))
    ids = torch.randint(0, 48, (3, 11))
    loss = model(ids, ids)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss.backward()
    for a, b in zip(first, [p.grad for p in model.parameters()]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scaling", ["static", "amax"])
def test_fp8_layers_cast_the_same_tensors_in_two_functions(monkeypatch, scaling):
    """An FP8-simulated GPT (`simulate_fp8` with an FP8Config) takes the two-Function form
    too, its FP8 linears lending it their casts: each cast (layer, role) sees the tensor it
    sees in the layers' own forms. The casts are recorded and left unrounded here: a float32
    rounding difference that moves a value across an FP8 rounding boundary would otherwise
    change it by a whole FP8 step, and that step would spread to every later value."""
    import ipu_unit_scaling as uu
    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.fp8 import linear as fp8_linear
    from ipu_unit_scaling.modules import gpt_blocks as modules
    from ipu_unit_scaling.transforms import simulate_fp8

    torch.manual_seed(0)
    model = uu.GPT(vocab_size=48, hidden_size=32, depth=2, heads=4, seq_len=12)
    simulate_fp8(model, FP8Config(scaling=scaling))
    ids = torch.randint(0, 48, (3, 11))
    # (as Python Functions, whose casts are the Python callables recorded here; the C++
    # nodes make the same casts: tests/ops/test_native_layers.py)
    monkeypatch.setattr(native_layers, "module", lambda: None)
    names = backward_nodes(model(ids, ids))
    assert names.count("_NormQKVBackward") == 2 and names.count("_ProjNormMLPBackward") == 2
    seen: dict = {}

    def record(x, fmt, margin, config, site):
        seen.setdefault(site, []).append(x.detach().clone())
        return x

    monkeypatch.setattr(fp8_linear, "values_for_role", record)
    _loss_and_grads(model, ids)
    two, seen = seen, {}
    monkeypatch.setattr(modules.TransformerBlock, "_two_function_form", lambda self, x: None)
    _loss_and_grads(model, ids)
    assert sorted(two) == sorted(seen) and len(seen) == 2 * 4 * 3 + 3  # + the readout's
    # Float32 throughout, join weights moved into GEMM alphas: a few 2**-24 roundings through
    # <= 128-term sums and two layers, as in the float test above: 1e-5 relative.
    for site, tensors in seen.items():
        assert len(two[site]) == len(tensors), site
        for got, want in zip(two[site], tensors):
            torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5,
                                       atol=1e-5 * want.abs().max().item(), msg=site)


@pytest.mark.parametrize("recipe", ["rowwise", "block", "mx", "nvfp4"])
def test_grouped_recipes_cast_the_same_tensors_in_two_functions(monkeypatch, recipe):
    """Under a grouped recipe the two-Function form casts each GEMM operand as the FP8
    linear does (`recipe_linear`): along its last dimension for the GEMM that reads it so,
    and along its first for the backward GEMM that reduces over it, each (layer, role,
    orientation) seeing the same tensor. Recorded unrounded, as in the test above."""
    import ipu_unit_scaling as uu
    from ipu_unit_scaling.fp8 import FP8Config, recipe_linear
    from ipu_unit_scaling.fp8.group_cast import GroupCast
    from ipu_unit_scaling.modules import gpt_blocks as modules
    from ipu_unit_scaling.transforms import simulate_fp8

    torch.manual_seed(0)
    model = uu.GPT(vocab_size=48, hidden_size=32, depth=2, heads=4, seq_len=12)
    simulate_fp8(model, FP8Config().with_recipe(recipe))
    ids = torch.randint(0, 48, (3, 11))
    monkeypatch.setattr(native_layers, "module", lambda: None)  # (as in the test above)
    names = backward_nodes(model(ids, ids))
    assert names.count("_NormQKVBackward") == 2 and names.count("_ProjNormMLPBackward") == 2
    seen: dict = {}

    def record(t, config, role, site, log2_scale, transposed, rows=True):
        along_rows = along_columns = None
        if rows:
            seen.setdefault(site, []).append(t.detach().clone())
            along_rows = GroupCast(t.detach().to(torch.float32), None)
        if transposed:
            seen.setdefault(f"{site}_t", []).append(t.detach().t().clone())
            along_columns = GroupCast(t.detach().t().to(torch.float32), None)
        return along_rows, along_columns

    monkeypatch.setattr(recipe_linear, "_casts", record)
    # (every cast through _casts: the host kernel's values-only path off)
    monkeypatch.setattr(recipe_linear, "host_pair_values", lambda *args: None)
    _loss_and_grads(model, ids)
    two, seen = seen, {}
    monkeypatch.setattr(modules.TransformerBlock, "_two_function_form", lambda self, x: None)
    _loss_and_grads(model, ids)
    # Per linear: input, weight and gradient along rows; input and gradient along columns,
    # and the weight too unless its blocks are square ("block" transposes its one cast).
    per_linear = 5 if recipe == "block" else 6
    assert sorted(two) == sorted(seen) and len(seen) == per_linear * (2 * 4 + 1)
    for site, tensors in seen.items():
        assert len(two[site]) == len(tensors), site
        for got, want in zip(two[site], tensors):
            torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5,
                                       atol=1e-5 * want.abs().max().item(), msg=site)


def test_grouped_two_functions_match_the_layers():
    """The MX recipe's two-Function layer gives the per-linear form's loss and gradients,
    to FP8 steps where a float32 rounding difference crosses a rounding boundary: compared
    in norm."""
    import ipu_unit_scaling as uu
    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.modules import gpt_blocks as modules
    from ipu_unit_scaling.transforms import simulate_fp8

    torch.manual_seed(0)
    model = uu.GPT(vocab_size=48, hidden_size=64, depth=2, heads=4, seq_len=12)
    simulate_fp8(model, FP8Config().with_recipe("mx"))
    ids = torch.randint(0, 48, (3, 11))
    loss = model(ids, ids)
    loss.backward()
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modules.TransformerBlock, "_two_function_form", lambda self, x: None)
        layers_loss = model(ids, ids)
        layers_loss.backward()
    # One FP8 step (E4M3: 2**-3 relative) in a few of the values moves a sum by far less.
    torch.testing.assert_close(loss, layers_loss, rtol=1e-3, atol=0)
    for a, p in zip(first, model.parameters()):
        assert torch.linalg.norm(a - p.grad) <= 0.05 * torch.linalg.norm(p.grad)


@pytest.mark.parametrize("form", ["python", "native"])
@pytest.mark.parametrize("expansion", [1, 4])
def test_grouped_casts_into_kept_buffers_change_nothing(monkeypatch, expansion, form):
    """The casts only the next GEMM reads go to buffers kept between calls (one per operand
    of the layer's Functions, in the Python Functions and in the C++ nodes): two training
    steps' losses and gradients are those made with fresh tensors, bit for bit, with the
    MLP's two weights the same shape (expansion 1) or not."""
    import ipu_unit_scaling as uu
    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.transforms import simulate_fp8

    def two_steps(nodes: bool) -> list:
        torch.manual_seed(0)
        model = uu.GPT(vocab_size=48, hidden_size=64, depth=2, heads=4, seq_len=12,
                       mlp_expansion=expansion)
        simulate_fp8(model, FP8Config().with_recipe("mx"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.randint(0, 48, (3, 11))
        results = []
        for _ in range(2):
            loss = model(ids, ids)
            assert any("CppNode" in name for name in backward_nodes(loss)) == nodes
            loss.backward()
            results += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
            optimizer.step()
            optimizer.zero_grad()
        return results

    held = fused_blocks._buffers.held = {}
    if form == "native":
        built_native_layers()
    else:
        monkeypatch.setattr(native_layers, "module", lambda: None)
    kept = two_steps(form == "native")
    if form == "python":
        assert len(held) >= 10  # (every slot of both Functions took its buffer)
    monkeypatch.setattr(native_layers, "module", lambda: None)
    monkeypatch.setattr(fused_blocks, "_buffer", lambda slot, like: None)
    for got, want in zip(kept, two_steps(False)):
        assert torch.equal(got, want)


def test_two_functions_hold_no_more_memory_than_five(monkeypatch, layer_form):
    """The two-Function layer keeps what the five Functions kept for the backward pass and no
    more: the output projection reads the attention output itself (no scaled copy held), and
    each intermediate is dropped once its gradient is made. Allocation sizes, not timings."""
    import ipu_unit_scaling as uu
    from benchmarks.measure import peak_step_bytes
    from ipu_unit_scaling.modules import gpt_blocks as modules

    torch.manual_seed(0)
    model = uu.GPT(vocab_size=64, hidden_size=64, depth=2, heads=4, seq_len=32)
    ids = torch.randint(0, 64, (4, 32))

    def step():
        model(ids, ids).backward()
        model.zero_grad(set_to_none=True)

    two = peak_step_bytes(step)
    monkeypatch.setattr(modules.TransformerBlock, "_two_function_form", lambda self, x: None)
    five = peak_step_bytes(step)
    assert two <= five, (two, five)
