"""Conversions of Hugging Face models that libraries walking the model keep: `unit_scale(...,
keep_structure=True)` keeps modules, classes and parameter names (Optimum Graphcore's
`parallelize` walks `model.bert.encoder.layer[i].attention`, `to_pipelined` reloads the state
dict, PopTorch's blocks are hooks on modules); `simulate_fp8` converts GPT-2's `Conv1D`;
converted layers follow the model's dtype; a converted model has a class that code rebuilding
the model from its config (and dropping the conversion) does not find."""
from __future__ import annotations

import copy
import inspect
import warnings
from typing import Dict, List, Tuple

import pytest
import torch
from helpers import transformers_with_torch
from torch import Tensor, nn

from ipu_unit_scaling.fp8 import FP8Config, FP8Linear
from ipu_unit_scaling.fp8.conv1d import FP8Conv1D, FP8UnitScaledConv1D
from ipu_unit_scaling.fp8.generic_formats import FPFormat
from ipu_unit_scaling.transforms import simulate_format, simulate_fp8, unit_scale_with_report

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, SEQ, BATCH, WIDTH = 64, 16, 4, 32



def _ids(seed: int) -> Tensor:
    return torch.randint(5, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def bert() -> Tuple[nn.Module, Dict[str, Tensor]]:
    transformers = transformers_with_torch()
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * WIDTH, max_position_embeddings=SEQ, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return (transformers.BertForSequenceClassification(config),
            dict(input_ids=_ids(1), labels=torch.tensor([0, 1, 2, 1])))


def gpt2() -> Tuple[nn.Module, Dict[str, Tensor]]:
    transformers = transformers_with_torch()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=WIDTH, n_layer=2, n_head=2, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    ids = _ids(2)
    return transformers.GPT2LMHeadModel(config), dict(input_ids=ids, labels=ids)


def llama() -> Tuple[nn.Module, Dict[str, Tensor]]:
    transformers = transformers_with_torch()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        use_cache=False)
    ids = _ids(3)
    return transformers.LlamaForCausalLM(config), dict(input_ids=ids, labels=ids)


MODELS = {"bert": bert, "gpt2": gpt2, "llama": llama}
BLOCKS = {"bert": "bert.encoder.layer", "gpt2": "transformer.h", "llama": "model.layers"}


def _convert(model: nn.Module, call: Dict[str, Tensor], keep_structure: bool):
    kwargs = {k: v for k, v in call.items() if k != "input_ids"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return unit_scale_with_report(model, (call["input_ids"],), kwargs,
                                      keep_structure=keep_structure)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_keep_structure_keeps_modules_names_and_the_conversion(name: str) -> None:
    """The same modules under the same names, the same parameter names and shapes; the same
    residuals as the graph form, and its loss on its weights."""
    model, call = MODELS[name]()
    graph_form, graph_report = _convert(model, call, keep_structure=False)
    kept, report = _convert(model, call, keep_structure=True)
    assert isinstance(kept, type(model))
    assert type(kept).__name__ == f"UnitScaled{type(model).__name__}"
    shapes = {key: value.shape for key, value in model.state_dict().items()}
    assert {key: value.shape for key, value in kept.state_dict().items()} == shapes
    original_paths = {path for path, _ in model.named_modules()}
    assert original_paths <= {path for path, _ in kept.named_modules()}
    assert report.residuals and len(report.residuals) == len(graph_report.residuals)

    # The graph form's weights, under the model's names (its keys add a graph module's path).
    weights = {key.split("inner.", 1)[-1]: value for key, value in graph_form.state_dict().items()}
    assert {key for key, _ in kept.named_parameters()} <= set(weights)
    # A buffer the graph never reads is not in it (transformers 4's `masked_bias`, `inv_freq`).
    weights = {**model.state_dict(), **weights}
    kept.load_state_dict({key: weights[key] for key in kept.state_dict()})
    loss, expected = kept(**call).loss, graph_form(**call).loss
    torch.testing.assert_close(loss, expected, rtol=0, atol=4 * 2 ** -24 * abs(expected.item()))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_kept_blocks_are_called_as_modules_so_hooks_and_class_swaps_apply(name: str) -> None:
    """A hook on a block fires (PopTorch's BeginBlock is a forward pre-hook); a class swapped
    below a converted module (Optimum swaps BERT's attention for a fused one) changes nothing,
    as the converted forward is the module's own attribute."""
    model, call = MODELS[name]()
    kept, _ = _convert(model, call, keep_structure=True)
    blocks = kept.get_submodule(BLOCKS[name])
    seen: List[int] = []
    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda module, args, index=index: seen.append(index))
    before = kept(**call).loss
    assert seen == list(range(len(blocks)))
    for block in blocks:
        block.__class__ = type("Swapped", (type(block),), {"forward": None})
    assert torch.equal(kept(**call).loss, before)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_kept_forward_has_the_original_signature_so_keyword_calls_bind(name: str) -> None:
    """Callers that bind a call to the forward's parameters by name (PopTorch's argument
    parser, which Optimum's IPUTrainer calls with a keyword batch) read the original forward's
    signature from the converted one, not (*args, **kwargs)."""
    model, call = MODELS[name]()
    original = inspect.signature(model.forward)
    kept, _ = _convert(model, call, keep_structure=True)
    assert inspect.signature(kept.forward) == original
    bound = inspect.signature(kept.forward).bind(**call)
    assert kept(*bound.args, **bound.kwargs).loss == kept(**call).loss


def test_kept_conversion_follows_half_and_deep_copies_independently() -> None:
    model, call = bert()
    kept, _ = _convert(model, call, keep_structure=True)
    twin = copy.deepcopy(kept)
    with torch.no_grad():
        twin.classifier.weight.mul_(0)  # the copy's forward reads the copy's weights
    assert not torch.equal(twin(**call).logits, kept(**call).logits)
    kept.half()
    assert {p.dtype for p in kept.parameters()} == {torch.float16}
    assert kept(**call).logits.dtype == torch.float16


def test_unit_scale_of_a_half_model_builds_half_layers() -> None:
    """unit_scale builds fresh layers; they take the dtype of those they replace."""
    model, call = bert()
    model.half()
    for keep_structure in (False, True):
        converted, _ = _convert(model, call, keep_structure)
        assert {p.dtype for p in converted.parameters()} == {torch.float16}
        assert converted(**call).logits.dtype == torch.float16


def test_a_registry_keyed_by_the_model_class_does_not_find_a_converted_model() -> None:
    """Optimum Graphcore's `to_pipelined` looks the model's class up in a registry of
    transformers classes and rebuilds the model from its config, which would drop the
    conversion: a converted model is of a subclass, which such a registry does not find."""
    model, call = bert()
    registry = {type(model): "rebuilds from the config"}
    kept, _ = _convert(model, call, keep_structure=True)
    assert registry.get(type(kept)) is None and isinstance(kept, type(model))
    in_place = simulate_fp8(bert()[0], FP8Config())
    assert registry.get(type(in_place)) is None
    assert type(in_place).__name__ == f"FP8{type(model).__name__}"
    assert registry.get(type(simulate_fp8(model))) is None
    unconverted = simulate_fp8(nn.Sequential(nn.ReLU()), FP8Config())
    assert type(unconverted) is nn.Sequential  # not a Hugging Face model: its class kept


def test_simulate_fp8_converts_gpt2s_conv1d_keeping_its_weights() -> None:
    model, call = gpt2()
    conv1d = type(model.transformer.h[0].attn.c_attn)
    sites = [n for n, m in model.named_modules() if isinstance(m, conv1d)]
    shapes = {key: value.shape for key, value in model.state_dict().items()}
    weight = model.transformer.h[0].mlp.c_fc.weight
    simulate_fp8(model, FP8Config())
    for site in sites:
        layer = model.get_submodule(site)
        assert isinstance(layer, FP8Conv1D), site
    assert model.transformer.h[0].mlp.c_fc.weight is weight  # shared, in Conv1D's layout
    assert {key: value.shape for key, value in model.state_dict().items()} == shapes
    layer = model.transformer.h[0].mlp.c_fc
    x = torch.randn(3, WIDTH)
    linear = FP8Linear.from_linear(nn.Linear(WIDTH, 4 * WIDTH), FP8Config(), "linear")
    with torch.no_grad():
        linear.weight.copy_(layer.weight.t())
        linear.bias.copy_(layer.bias)
    torch.testing.assert_close(layer(x), linear(x), rtol=0, atol=0)
    model.half()
    assert model(**call).logits.dtype == torch.float16


def test_simulate_fp8_converts_a_unit_scaled_conv1d() -> None:
    model, call = gpt2()
    kept, _ = _convert(model, call, keep_structure=True)
    simulate_fp8(kept, FP8Config())
    assert isinstance(kept.transformer.h[1].attn.c_proj, FP8UnitScaledConv1D)
    loss = kept(**call).loss
    loss.backward()
    assert torch.isfinite(loss) and kept.transformer.h[1].attn.c_proj.weight.grad is not None


def test_simulate_format_quantises_the_addmm_of_a_conv1d() -> None:
    """unit-scaling's graph form casts `torch.addmm` operands (Conv1D's matmul) as it casts
    `F.linear`'s: the output is that of the quantised operands, within the sum's rounding."""
    transformers_with_torch()
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(8, 16)
    nn.init.normal_(conv.weight)
    x = torch.randn(5, 16)
    nearest, gradient = FPFormat(4, 3, "nearest"), FPFormat(5, 2, "nearest")
    quantised = simulate_format(conv, nearest, gradient)(x)
    qx, qw = nearest.quantise(x), nearest.quantise(conv.weight.detach())
    expected = torch.addmm(conv.bias.detach(), qx, qw)
    bound = 17 * 2 ** -24 / (1 - 17 * 2 ** -24) * (qx.abs() @ qw.abs() + conv.bias.abs())
    assert torch.all((quantised - expected).abs() <= bound.detach())
    assert not torch.allclose(quantised, conv(x))
