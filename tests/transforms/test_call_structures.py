"""unit_scale without example inputs on a model shaped like nanoGPT's GPT: a size assertion,
position embeddings, weight tying, an optional `targets` argument, and methods that scripts
call (`configure_optimizers`, `generate`)."""
from __future__ import annotations

import math
from typing import Tuple

import pytest
import torch
from torch import Tensor

from ipu_unit_scaling import transforms
from ipu_unit_scaling.transforms import unit_scale, unit_scale_with_report
from tests.helpers import torch_before
from tests.transforms.nanogpt_shaped import Config, TinyGPT

needs_dynamo = pytest.mark.skipif(
    torch_before(2, 1), reason="graph transforms capture with TorchDynamo, which traces into nn "
    "modules from torch 2.1")


def _batch(config: Config, rows: int = 4) -> Tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (rows, config.block_size + 1),
                           generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def test_a_nanogpt_shaped_model_converts_fully_without_example_inputs():
    torch.manual_seed(0)
    model = TinyGPT(Config())
    converted, report = unit_scale_with_report(model)
    assert report.untraceable == [] and report.unconverted == []
    # both adds of each block are residuals; the embedding sum is a unit-scaled add
    assert len(report.residuals) == 2 * model.config.n_layer, report.residuals
    assert any(name.endswith("add") for name in report.converted), report.converted


def test_the_converted_model_keeps_its_class_attributes_methods_and_state_dict_keys():
    torch.manual_seed(0)
    model = TinyGPT(Config())
    converted = unit_scale(model)
    assert type(converted) is TinyGPT and converted.config is not model.config
    assert converted.config == model.config
    assert list(converted.state_dict()) == list(model.state_dict())
    assert converted.transformer.wte.weight is converted.lm_head.weight  # still tied
    assert len(list(converted.parameters())) == len(list(model.parameters()))
    optimizer = converted.configure_optimizers(0.01)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(
        list(converted.parameters()))
    x, y = _batch(model.config)
    logits, loss = converted(x, y)
    assert loss is not None and logits.shape == (4, 16, 23)
    loss.backward()
    optimizer.step()
    text = converted.generate(x[:1, :3], 5)
    assert text.shape == (1, 8)


def test_a_call_without_targets_is_converted_with_the_same_layers_at_its_first_call():
    torch.manual_seed(0)
    model = TinyGPT(Config())
    converted = unit_scale(model)
    parameters = [id(p) for p in converted.parameters()]
    x, y = _batch(model.config)
    converted.eval()
    full, loss = converted(x, y)
    last, none = converted(x)
    assert none is None and last.shape == (4, 1, 23)
    assert [id(p) for p in converted.parameters()] == parameters  # no new parameters
    # the same layers on the same values: the last position's logits agree up to float32
    # rounding over the model's few ops (unit roundoff 2**-24 times far fewer than 2**10)
    torch.testing.assert_close(last[:, 0], full[:, -1], rtol=2**-14, atol=2**-14)
    # and the model is unit-scaled in both: the logits are not the original's
    original_last, _ = model.eval()(x)
    assert not torch.allclose(original_last, last)


def test_an_assertion_on_a_size_stays_a_check_of_every_call():
    model = TinyGPT(Config(block_size=8))
    converted = unit_scale(model)
    tokens = torch.zeros(2, 9, dtype=torch.long)
    with pytest.raises(AssertionError):
        converted(tokens, tokens)
    with pytest.raises(AssertionError):
        converted(tokens)


def test_a_shorter_sequence_runs_the_same_converted_graph():
    model = TinyGPT(Config())
    converted = unit_scale(model)
    x, y = _batch(model.config)
    _, loss = converted(x[:, :5].contiguous(), y[:, :5].contiguous())
    assert loss is not None and math.isfinite(loss.item())
    assert converted.forward.converted == {}  # calls with every argument use the traced graph


def test_the_copy_is_independent_and_deep_copies_convert_their_own_calls():
    import copy

    model = TinyGPT(Config())
    converted = unit_scale(model)
    x, _ = _batch(model.config)
    converted(x)
    twin = copy.deepcopy(converted)
    with torch.no_grad():
        # Not a constant: the head's weight is tied to the embedding, and a constant added to
        # both is undone by the LayerNorms' centring (the logits move by a multiple of a
        # centred row's sum).
        twin.lm_head.weight.add_(torch.randn(twin.lm_head.weight.shape,
                                             generator=torch.Generator().manual_seed(0)))
    a, _ = converted(x)
    b, _ = twin(x)
    assert not torch.allclose(a, b)


@needs_dynamo
def test_backends_name_the_transforms_a_model_carries_as_unit_scaling_records_them():
    model = TinyGPT(Config())
    fp8 = transforms.simulate_fp8(model)
    both = unit_scale(fp8)
    names = [b.__qualname__ for b in both.backends]
    assert len(names) == 2 and "unit_scaling" in names[0] and "quantisation" in names[1]
    assert [b.__qualname__ for b in fp8.backends] == names[1:]
    assert not hasattr(model, "backends")
    x, y = _batch(model.config)
    _, loss = both(x, y)
    assert loss is not None and math.isfinite(loss.item())
    assert type(both).__name__ == "TinyGPT" and both.config == model.config
    # a call without targets is converted outside TorchDynamo's capture, then captured
    assert both.generate(x[:1, :3], 2).shape == (1, 5)
    assert len(both.forward.base_forward.converted) == 1
