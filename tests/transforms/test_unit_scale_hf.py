"""unit_scale on the models people use: Hugging Face BERT (traced with torch.export, as fx
cannot) and Llama (fx, with RMSNorm, SwiGLU, rotary embeddings and grouped-query attention),
built from small configs; and the torch.export fallback on a model without transformers."""
from __future__ import annotations

import statistics
import warnings
from typing import Dict, List, Tuple

import pytest
import torch
from helpers import transformers_with_torch
from torch import Tensor, nn

import ipu_unit_scaling as uu
from ipu_unit_scaling.transforms import unit_scale, unit_scale_with_report
from ipu_unit_scaling.transforms.export import export_unavailable
from ipu_unit_scaling.transforms.fx_tracing import function_behind
from ipu_unit_scaling.transforms.replacements import scale_preserving_functions

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, SEQ, BATCH = 64, 32, 8



def _transformers_4() -> bool:
    return transformers_with_torch().__version__.startswith("4.")


def _needs_export() -> None:
    reason = export_unavailable()
    if reason is not None:
        pytest.skip(reason)


def random_tokens(seed: int) -> Tensor:
    """Independent uniform tokens: the data unit scaling's rules assume at initialisation
    (repetitive text correlates the rows that weight gradients sum, making them larger)."""
    return torch.randint(5, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def markov_batches(steps: int, seed: int = 0, successors_per_token: int = 2) -> List[Tensor]:
    """Token sequences from a sparse random Markov chain: learnable from context."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(5, VOCAB, (VOCAB, successors_per_token), generator=generator)
    batches = []
    for _ in range(steps):
        current = torch.randint(5, VOCAB, (BATCH,), generator=generator)
        sequence = [current]
        for _ in range(SEQ - 1):
            pick = torch.randint(0, successors_per_token, (BATCH,), generator=generator)
            current = successors[current, pick]
            sequence.append(current)
        batches.append(torch.stack(sequence, dim=1))
    return batches


MASK_ID = 4


def mask_tokens(ids: Tensor, seed: int) -> Tuple[Tensor, Tensor]:
    """BERT's masking: 15% of positions are predicted; their input is the mask token."""
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.rand(ids.shape, generator=generator) < 0.15
    chosen[:, 0] = True  # at least one target per row
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return torch.where(chosen, torch.full_like(ids, MASK_ID), ids), labels


def gradient_stds(model: nn.Module, **call: Tensor) -> Dict[str, float]:
    model.zero_grad(set_to_none=True)
    model(**call).loss.backward()
    return {name: p.grad.std().item() for name, p in model.named_parameters()
            if p.grad is not None}


def fraction_in_unit_band(stds: Dict[str, float]) -> float:
    return sum(0.5 <= s <= 2 for s in stds.values()) / len(stds)


def train_losses(model: nn.Module, batches: List[Dict[str, Tensor]], lr: float) -> List[float]:
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for call in batches:
        loss = model(**call).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


def _convert(model: nn.Module, args: Tuple[Tensor, ...], kwargs: Dict[str, object]):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return unit_scale_with_report(model, args, kwargs)


# ---------------------------------------------------------------- Llama


def llama(**overrides: object) -> nn.Module:
    transformers = transformers_with_torch()
    torch.manual_seed(0)
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=SEQ)
    settings.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))


@pytest.fixture(scope="module")
def llama_pair():
    model = llama()
    ids = random_tokens(seed=5)
    converted, report = _convert(model, (ids,), {"labels": ids, "use_cache": False})
    return model, converted, report, ids


def test_llama_converts_fully_with_fx(llama_pair):
    _, converted, report, _ = llama_pair
    assert report.tracers == ["LlamaForCausalLM: torch.fx"]
    assert not report.untraceable and not report.unconverted
    assert len(report.residuals) == 4
    kinds = {type(m) for m in converted.modules()}
    assert {uu.RMSNorm, uu.Linear, uu.Embedding} <= kinds
    from transformers.models.llama import modeling_llama

    targets = [node.target for node in converted.graph_module.graph.nodes]
    names = [getattr(target, "__name__", str(target)) for target in targets]
    assert names.count("unit_silu_glu") == 2 and "silu" not in names
    assert names.count("unit_scaled_dot_product_attention") == 2
    # Rotary embeddings are kept whole: one call per layer, and no sum in them is rescaled.
    # (transformers 5 makes the global a module standing for the function: the graph calls
    # the function.)
    rotary = modeling_llama.apply_rotary_pos_emb
    assert targets.count(function_behind(rotary) or rotary) == 2
    assert "unit_add" not in names
    # q, k and v read the same normalised input, and so do gate and up: one shared scale.
    attention = converted.graph_module.get_submodule("inner.model.layers.0.self_attn")
    # 64 + 32 + 32 (transformers 4 has no grouped-query attention: 64 + 64 + 64)
    widths = 64 + attention.k_proj.out_features + attention.v_proj.out_features
    assert repr(attention.q_proj.constraint) == f"SharedInputGmean({widths})"
    mlp = converted.graph_module.get_submodule("inner.model.layers.0.mlp")
    assert repr(mlp.gate_proj.constraint) == "SharedInputGmean(256)"


def test_llama_gradients_are_unit_after_conversion_and_tiny_before(llama_pair):
    model, converted, _, ids = llama_pair
    before = gradient_stds(model, input_ids=ids, labels=ids, use_cache=False)
    after = gradient_stds(converted, input_ids=ids, labels=ids, use_cache=False)
    assert len(after) == len(before) == 21
    assert statistics.median(before.values()) < 1e-2
    assert fraction_in_unit_band(after) >= 0.9, after


def test_llama_report_lists_what_stays_unscaled():
    """An activation unit scaling has no rule for (tanh) is kept and named, with its gate."""
    model = llama(hidden_act="tanh", num_hidden_layers=1)
    ids = markov_batches(1)[0]
    _, report = _convert(model, (ids,), {"labels": ids, "use_cache": False})
    activation, gate = sorted(report.unconverted)
    assert activation == "model.layers.0.mlp.act_fn (Tanh)"
    assert gate.startswith("mul") and gate.endswith(" (mul)")  # act(gate) * up: no rule for it
    assert "left unscaled: " in report.summary() and "act_fn (Tanh)" in report.summary()


def test_converted_llama_trains_loss_falls():
    model = llama()
    batches = markov_batches(51, seed=1)
    converted = unit_scale(model, (batches[0],), {"labels": batches[0], "use_cache": False})
    losses = train_losses(converted, [dict(input_ids=b, labels=b, use_cache=False)
                                      for b in batches[1:]], lr=1e-2)
    assert sum(losses[-5:]) / 5 < 0.75 * losses[0], losses


def test_rotary_embedding_preserves_norms_and_gradient_norms_exactly():
    """The proof of scale preservation, on the function itself: each pair (x_i, x_{i+d/2})
    is rotated by its position's angle, so every pair keeps its norm (float64, exactly up to
    rounding), and so does the gradient, which goes through the transposed rotation."""
    transformers_with_torch()
    from transformers.models.llama import modeling_llama

    assert modeling_llama.apply_rotary_pos_emb in scale_preserving_functions()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, SEQ, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, SEQ, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(SEQ).expand(2, SEQ)
    if _transformers_4():  # a table for every position, indexed by the call's positions
        rotary = modeling_llama.LlamaRotaryEmbedding(16, SEQ)
        cos, sin = rotary(q, seq_len=SEQ)
        q_out, k_out = modeling_llama.apply_rotary_pos_emb(
            q, k, cos.double(), sin.double(), positions)
    else:
        rotary = modeling_llama.LlamaRotaryEmbedding(llama().config)
        cos, sin = rotary(q, positions)
        q_out, k_out = modeling_llama.apply_rotary_pos_emb(q, k, cos.double(), sin.double())

    def pair_norms(x: Tensor) -> Tensor:
        return x[..., :8] ** 2 + x[..., 8:] ** 2

    torch.testing.assert_close(pair_norms(q_out), pair_norms(q.detach()))
    torch.testing.assert_close(pair_norms(k_out), pair_norms(k.detach()))
    grad_q = torch.randn(q_out.shape, generator=gen, dtype=torch.float64)
    grad_k = torch.randn(k_out.shape, generator=gen, dtype=torch.float64)
    torch.autograd.backward([q_out, k_out], [grad_q, grad_k])
    torch.testing.assert_close(pair_norms(q.grad), pair_norms(grad_q))
    torch.testing.assert_close(pair_norms(k.grad), pair_norms(grad_k))
    assert not torch.allclose(q_out, q.detach())  # it does rotate


# ---------------------------------------------------------------- BERT


def bert() -> nn.Module:
    transformers = transformers_with_torch()
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=SEQ))


def bert_call(ids: Tensor, seed: int) -> Dict[str, Tensor]:
    inputs, labels = mask_tokens(ids, seed)
    padding = torch.ones_like(ids)
    padding[0, SEQ - 6:] = 0  # one padded sequence: a boolean key mask in attention
    labels[0, SEQ - 6:] = -100
    segments = torch.zeros_like(ids)
    segments[:, SEQ // 2:] = 1  # two segments, as in BERT's pretraining pairs
    return dict(input_ids=inputs, attention_mask=padding, token_type_ids=segments,
                labels=labels)


@pytest.fixture(scope="module")
def bert_pair():
    transformers_with_torch()
    _needs_export()
    model = bert()
    call = bert_call(random_tokens(seed=5), seed=0)
    args = (call["input_ids"],)
    kwargs = {k: v for k, v in call.items() if k != "input_ids"}
    converted, report = _convert(model, args, kwargs)
    return model, converted, report, call


def test_bert_is_traced_with_fx_and_converts_fully(bert_pair):
    """fx reads the position-id buffer as a graph input, so `position_ids[:, :length]` is
    traced; transformers 4's attention, written out, is read as one attention call."""
    model, converted, report, call = bert_pair
    assert report.tracers == ["BertForMaskedLM: torch.fx"]
    assert not report.untraceable and not report.unconverted
    assert len(report.residuals) == 4  # post-LN: attention and MLP residual of each layer
    kinds = [type(m) for m in converted.modules()]
    assert nn.Linear not in kinds and nn.LayerNorm not in kinds and nn.Embedding not in kinds
    code = converted.graph_module.code
    for name in ("unit_attention", "unit_cross_entropy", "unit_add"):
        assert name in code, name
    # The output layer still shares its weight with the input embedding, as in the model.
    inner = converted.graph_module.inner
    assert inner.cls.predictions.decoder.weight is inner.bert.embeddings.word_embeddings.weight
    # Same value as the model computes for the same weights? Not comparable (re-initialised);
    # but the loss is a mean cross-entropy over the masked positions only.
    assert torch.isfinite(converted(**call).loss)


def _check_bert_gradients(before: Dict[str, float], after: Dict[str, float]) -> None:
    assert len(after) == len(before) == 42
    assert statistics.median(before.values()) < 1e-2
    assert 0.5 <= statistics.median(after.values()) <= 2
    weights = {name: std for name, std in after.items() if name.endswith(".weight")}
    assert len(weights) == 22
    assert fraction_in_unit_band(weights) >= 0.9, weights
    assert fraction_in_unit_band(after) >= 0.85, after
    value_biases = {name: std for name, std in after.items() if name.endswith("value.bias")}
    assert len(value_biases) == 2 and all(0.5 <= s <= 2 for s in value_biases.values()), after
    for name, std in after.items():
        if name.endswith("key.bias"):
            assert std < 1e-4, (name, std)
        elif not 0.5 <= std <= 2:
            if name.endswith("value.weight"):
                assert 2 < std < 3, (name, std)
            else:
                assert name.endswith(("self.query.weight", "self.query.bias",
                                      "self.key.weight")), (name, std)
                assert 0.35 < std < 0.5, (name, std)


def test_bert_gradients_after_conversion(bert_pair):
    """At least 90% of the weight gradients and 85% of all parameter gradients reach [0.5, 2],
    from a plain median near 2^-8, on this draw of the data and on four more (the next test).
    Here all 22 weights and 40 of the 42 parameters. Over 8 draws of the data times 4 of
    dropout (3 in training mode, 1 in evaluation), 20 to 22 of the 22 weights and 38 to 40 of
    the 42 parameters. Each parameter outside the band is one of:

    - a key bias: it shifts every logit of a row alike, which softmax ignores, so its
      gradient is exactly zero (nothing can scale it);
    - a query bias, and rarely a query or key weight (0.38 to 0.5, mostly the last layer's).
      `unit_scale` marks the query and key projections and scales their parameters' gradients
      by `U.attention_query_key_grad_scale` (x1.11 for 32 keys), which makes them unit for
      independent unit inputs. Here the three projections share their input, so their
      `SharedInputGmean` constraint sets their outputs' std to (64 * 192)**-0.25 * sqrt(64),
      about 0.76, and the logits' std below 1; without the rule they were 0.35 to 0.5, and
      the 90% weight target failed on 3 of 8 draws;
    - in some draws, a value projection's weight (2.0 to 2.6): at initialisation each query
      spreads its gradient almost evenly over the keys, so the rows of the value gradient are
      alike and sum coherently with the inputs' shared component (the segment and position
      embeddings are shared by many rows).

    Value biases are in the band: `unit_scale` divides their gradient by attention's row scale
    (`U.attention_value_bias_grad_scale`); without that they were 3.3 to 4.3.
    """
    model, converted, _, call = bert_pair
    torch.manual_seed(0)  # attention and hidden dropout are on: the same masks in any test order
    before = gradient_stds(model, **call)
    torch.manual_seed(0)
    after = gradient_stds(converted, **call)
    _check_bert_gradients(before, after)
    roles = sorted(m.attention_projection.role for m in converted.modules()
                   if getattr(m, "attention_projection", None) is not None)
    assert roles == ["key", "key", "query", "query", "value", "value"]


@pytest.mark.parametrize("draw", [1, 2, 3, 4])
def test_bert_gradients_after_conversion_on_other_draws(draw):
    """The same bands on other draws of the data and the masking: draws 1 to 3 were where the
    query and key weights fell out before their rule, draw 4 where both value weights do."""
    transformers_with_torch()
    _needs_export()
    model = bert()
    call = bert_call(random_tokens(seed=5 + draw), seed=draw)
    args = (call["input_ids"],)
    converted, _ = _convert(model, args, {k: v for k, v in call.items() if k != "input_ids"})
    torch.manual_seed(0)
    before = gradient_stds(model, **call)
    torch.manual_seed(0)
    _check_bert_gradients(before, gradient_stds(converted, **call))


def test_bert_original_untouched_deterministic_and_arguments_guarded(bert_pair):
    model, converted, _, call = bert_pair
    state = {k: v.clone() for k, v in model.state_dict().items()}
    args = (call["input_ids"],)
    kwargs = {k: v for k, v in call.items() if k != "input_ids"}
    again = unit_scale(model, args, kwargs)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert all(type(m).__module__.startswith(("torch", "transformers")) for m in model.modules())
    converted.eval()
    again.eval()
    torch.testing.assert_close(converted(**call).logits, again(**call).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="specialised"):
        converted(**call, output_hidden_states=True)
    # Shapes stayed dynamic: another batch size and length run.
    shorter = {k: v[:3, :20].contiguous() for k, v in call.items()}
    assert converted(**shorter).logits.shape == (3, 20, VOCAB)


def test_converted_bert_trains_masked_lm_loss_falls():
    transformers_with_torch()
    _needs_export()
    # One successor per token: a masked token is its neighbours' business, which a small
    # bidirectional model picks up within 50 steps (with two it first learns unigrams).
    batches = markov_batches(51, seed=2, successors_per_token=1)
    calls = [bert_call(ids, seed) for seed, ids in enumerate(batches)]
    args = (calls[0]["input_ids"],)
    kwargs = {k: v for k, v in calls[0].items() if k != "input_ids"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        converted = unit_scale(bert(), args, kwargs)
    losses = train_losses(converted, calls[1:], lr=2e-2)
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5, losses


# ---------------------------------------------------------------- the fallback itself


class SlicesATensor(nn.Module):
    """A pattern that stops fx: a tensor made in `forward` sliced by the input's length."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(16, 32)
        self.positions = nn.Embedding(24, 32)
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, 16)

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:
        positions = torch.arange(24).unsqueeze(0)[:, : ids.shape[1]]
        hidden = self.tokens(ids) + self.positions(positions)
        hidden = hidden + self.fc(torch.relu(hidden))
        logits = self.head(hidden)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class KeywordCall(nn.Module):
    """A Hugging Face model called with named tensors given positionally (the PopTorch check
    traces positional inputs), returning the loss."""

    def __init__(self, model: nn.Module, names: List[str], **fixed: object) -> None:
        super().__init__()
        self.model, self.names, self.fixed = model, names, fixed

    def forward(self, *tensors: Tensor) -> Tensor:
        return self.model(**dict(zip(self.names, tensors)), **self.fixed).loss


def test_converted_models_pass_the_poptorch_check(llama_pair, bert_pair):
    """Traced as PopTorch traces a training model (BERT with its dropout on), the converted
    Llama and BERT use only ops PopTorch has handlers for. (So do the originals: PopTorch traces
    fused attention as its math form.) No IPU: `check_poptorch`'s emulation of PopTorch's op
    list."""
    from ipu_unit_scaling.ipu import check_poptorch

    _, converted, _, ids = llama_pair
    names = ["input_ids", "labels"]
    assert check_poptorch(KeywordCall(converted, names, use_cache=False), ids, ids).ok

    _, converted, _, call = bert_pair
    names = list(call)
    converted.train()
    assert check_poptorch(KeywordCall(converted, names), *call.values()).ok


def test_export_fallback_where_fx_fails():
    _needs_export()
    torch.manual_seed(0)
    model = SlicesATensor()
    ids = torch.randint(0, 16, (4, 12))
    labels = torch.randint(0, 16, (4, 12))
    converted, report = unit_scale_with_report(model, (ids, labels))
    (tracer,) = report.tracers
    assert tracer.startswith("SlicesATensor: torch.export (dynamic shapes; torch.fx failed "
                             "with TypeError")
    assert not report.unconverted and len(report.residuals) == 1
    code = converted.graph_module.code
    assert "unit_residual_add" in code and "unit_relu" in code and "aten_cross_entropy" in code
    assert isinstance(converted.graph_module.get_submodule("inner.fc"), uu.Linear)
    loss = converted(ids, labels)
    loss.backward()
    # A length the model was not traced with: positions follow it, as in eager.
    assert torch.isfinite(converted(ids[:, :7].contiguous(), labels[:, :7].contiguous()))


def test_without_export_the_fallback_says_why(monkeypatch):
    from ipu_unit_scaling.transforms import export

    monkeypatch.setattr(export, "export_unavailable", lambda: "no torch.export in this test")
    model = SlicesATensor()
    ids = torch.randint(0, 16, (4, 12))
    _, report = unit_scale_with_report(model, (ids, ids))
    assert report.tracers[0] == "SlicesATensor: not traced (no torch.export in this test)"
    assert report.untraceable and report.untraceable[0].startswith("SlicesATensor: TypeError")


# ---------------------------------------------------------------- transformers versions


@pytest.mark.parametrize("version", ["4.28.1", "4.30.0", "5.18.0", "6.0.0"])
def test_an_untested_transformers_is_refused_in_one_line(monkeypatch, version):
    """Outside the tested range, a Hugging Face model is refused, not converted halfway; a
    model without transformers layers converts whatever transformers says."""
    from ipu_unit_scaling.transforms import fx_tracing

    model = llama(num_hidden_layers=1)
    ids = random_tokens(seed=5)
    monkeypatch.setattr(fx_tracing, "_transformers_version", lambda: version)
    with pytest.raises(RuntimeError) as refusal:
        unit_scale(model, (ids,), {"labels": ids, "use_cache": False})
    message = str(refusal.value)
    oldest, newest = fx_tracing.TRANSFORMERS_TESTED
    assert "\n" not in message
    assert message.startswith("unit_scale supports transformers 4.29.* and >=5.19,<6 ")
    assert f"tested on {oldest}, 5.19.0 and {newest}" in message
    assert f"this is transformers {version}" in message
    plain = SlicesATensor()
    unit_scale(plain, (torch.randint(0, 16, (2, 6)), torch.randint(0, 16, (2, 6))))


def test_the_installed_transformers_is_in_the_tested_range():
    transformers = transformers_with_torch()
    from ipu_unit_scaling.transforms.fx_tracing import transformers_unsupported

    assert transformers_unsupported(llama(num_hidden_layers=1)) is None, transformers.__version__


def test_gpt2_converts_fully_with_fx():
    transformers = transformers_with_torch()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ))
    ids = random_tokens(seed=5)
    _, report = _convert(model, (ids,), {"labels": ids, "use_cache": False})
    assert report.tracers == ["GPT2LMHeadModel: torch.fx"]
    assert not report.untraceable and not report.unconverted
    assert len(report.residuals) == 4


def test_llama_through_the_export_fallback_keeps_its_rms_norms_whole(monkeypatch):
    """Where fx fails, torch.export traces Llama; each RMSNorm is one module there too. Its
    `hidden_states.to(float32)` returns its input, and export's node for it is what the
    residual reads: read as the input, the norm has one input and one output and is converted
    whole (before, the decoder layers' norms stayed as unscaled ops, gradients near 15). On
    transformers 5.19 the rotary embedding's `torch.autocast` block is a nested graph, which
    the converted model holds too."""
    if _transformers_4():
        pytest.skip("transformers 4's model outputs are no pytree nodes: torch.export cannot "
                    "return them (fx traces its Llama)")
    _needs_export()
    import sys

    unit_scale_module = sys.modules["ipu_unit_scaling.transforms.unit_scale"]

    def fx_fails(*args: object, **kwargs: object) -> None:
        raise TypeError("torch.fx made to fail in this test")

    monkeypatch.setattr(unit_scale_module, "trace_module", fx_fails)
    model = llama()
    ids = random_tokens(seed=5)
    converted, report = _convert(model, (ids,), {"labels": ids, "use_cache": False})
    (tracer,) = report.tracers
    assert tracer.startswith("LlamaForCausalLM: torch.export")
    assert not any("layernorm" in op or ".norm" in op for op in report.unconverted), report
    assert sum(isinstance(m, uu.RMSNorm) for m in converted.modules()) == 5
    after = gradient_stds(converted, input_ids=ids, labels=ids, use_cache=False)
    norms = {name: std for name, std in after.items() if "norm" in name}
    assert len(norms) == 5 and fraction_in_unit_band(norms) == 1, norms
