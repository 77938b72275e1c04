"""Unit-scaled Hugging Face BERT, GPT-2 and Llama in a plain `poptorch.trainingModel` (the
stand-in, as `ipu-unit-scaling emulate` gives it to a program): they compile, train, and the
gradients PopTorch's way (derived from the traced forward graph) equal the eager ones."""
from __future__ import annotations

import sys
import warnings
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from helpers import transformers_with_torch
from torch import Tensor, nn

from ipu_unit_scaling.transforms import unit_scale

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, SEQ, BATCH, WIDTH = 64, 16, 4, 32
_U = 2.0 ** -24  # float32 unit roundoff



@pytest.fixture
def poptorch(monkeypatch: pytest.MonkeyPatch):
    """The stand-in as a program's `import poptorch` finds it under `emulate`."""
    from ipu_unit_scaling.backends.poptorch_backend import poptorch_module

    standin = poptorch_module("emulator")
    monkeypatch.setitem(sys.modules, "poptorch", standin)
    return standin


def _bert() -> Tuple[nn.Module, Dict[str, Tensor]]:
    transformers = transformers_with_torch()
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * WIDTH, max_position_embeddings=SEQ, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, SEQ - 4:] = 0
    return (transformers.BertForSequenceClassification(config),
            dict(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 2, 1])))


def _gpt2() -> Tuple[nn.Module, Dict[str, Tensor]]:
    transformers = transformers_with_torch()
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=WIDTH, n_layer=2, n_head=2, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    return transformers.GPT2LMHeadModel(config), dict(input_ids=ids, labels=ids)


def _llama() -> Tuple[nn.Module, Dict[str, Tensor]]:
    transformers = transformers_with_torch()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        use_cache=False)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    return transformers.LlamaForCausalLM(config), dict(input_ids=ids, labels=ids)


MODELS: Dict[str, Callable[[], Tuple[nn.Module, Dict[str, Tensor]]]] = {
    "bert": _bert, "gpt2": _gpt2, "llama": _llama}


class LossOf(nn.Module):
    """A Hugging Face model called with its named tensors given positionally (PopTorch passes
    a training model's inputs positionally), returning the loss."""

    def __init__(self, model: nn.Module, names: List[str]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *tensors: Tensor) -> Tensor:
        return self.model(**dict(zip(self.names, tensors))).loss


def _converted(name: str, keep_structure: bool = False) -> Tuple[LossOf, Dict[str, Tensor]]:
    torch.manual_seed(0)
    model, call = MODELS[name]()
    ids = call["input_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        converted = unit_scale(model, (ids,), {k: v for k, v in call.items() if k != "input_ids"},
                               keep_structure=keep_structure)
    return LossOf(converted, list(call)), call


@pytest.mark.parametrize("keep_structure", [False, True], ids=["graph", "kept"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_traced_gradients_equal_eager_ones(name: str, keep_structure: bool, poptorch) -> None:
    """Every parameter's gradient from one trainingModel step (anchored as PopART names it)
    against the eager gradient of the same converted model, outside the IPU's own lowerings
    (`torch_numerics`). The two differ by rounding only: the traced forms (explicit attention
    in place of the fused kernel, layer norm differentiated op by op) compute the same sums in
    another order. A weight gradient element sums BATCH * SEQ products (gamma of that many
    roundings); the layer norms' and softmaxes' backward passes subtract a mean over at most
    WIDTH elements from each, which can amplify that error by up to WIDTH. Judged norm-wise on
    the whole gradient: a bias whose exact gradient is zero (a key bias, shifted out by the
    softmax) has a computed one made of rounding alone."""
    from ipu_standins.poptorch_settings import torch_numerics

    wrapped, call = _converted(name, keep_structure)
    wrapped.train()
    eager = dict(wrapped.named_parameters())
    wrapped.zero_grad()
    wrapped(*call.values()).backward()
    expected = {n: p.grad.detach().clone() for n, p in eager.items() if p.grad is not None}
    assert expected, "no parameter has a gradient"
    wrapped.zero_grad(set_to_none=True)

    options = poptorch.Options()
    for index, parameter in enumerate(expected):
        options.anchorTensor(f"g{index}", f"Gradient___{parameter}")
    training = poptorch.trainingModel(
        wrapped, options, poptorch.optim.SGD(wrapped.parameters(), lr=0.0))
    with torch_numerics():
        loss = training(*call.values())
    assert torch.isfinite(loss).all()
    bound = BATCH * SEQ * WIDTH * _U
    total = torch.cat([g.flatten() for g in expected.values()]).norm().item()
    traced = torch.cat([training.getAnchoredTensor(f"g{index}").flatten()
                        for index in range(len(expected))])
    eager_flat = torch.cat([g.flatten() for g in expected.values()])
    assert (traced - eager_flat).norm().item() <= bound * total


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trains_in_a_training_model_loss_falls(name: str, poptorch) -> None:
    wrapped, call = _converted(name)
    training = poptorch.trainingModel(
        wrapped, optimizer=poptorch.optim.Adam(wrapped.parameters(), lr=3e-3))
    losses = [float(training(*call.values())) for _ in range(8)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses
