"""Evaluation and sampling of trained runs, in every precision, on the host and the emulator."""
from __future__ import annotations

import copy
import json
import math
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from helpers import ONE_IPU

from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.apps.pretrained import (
    TrainedRun,
    evaluate_run,
    format_evaluation,
    open_run,
    sample_run,
    write_evaluation,
)
from ipu_unit_scaling.backends import select_backend
from ipu_unit_scaling.fp8 import FP8Config, FP8Linear
from ipu_unit_scaling.loop.training_loop import train
from ipu_unit_scaling.training.config_names import PRECISION_NAMES
from ipu_unit_scaling.training.data import CharTokenizer, DataError, embedded_corpus, get_batch
from ipu_unit_scaling.training.inference import (
    PRECISIONS,
    LanguageModelLoss,
    encode_known,
    generate,
    mean_loss,
    precision_config,
    text_batches,
)
from ipu_unit_scaling.training.precision import regime_config
from ipu_unit_scaling.training.run_config import Config, load_config
from ipu_unit_scaling.training.run_directory import RunError
from ipu_unit_scaling.training.run_records import read_metrics
from ipu_unit_scaling.transforms import simulate_fp8

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(*overrides: str) -> Config:
    """The tiny test model on one IPU, ten steps, validated at the end."""
    return load_config("tiny", [
        *ONE_IPU,
        "training.steps=10", "training.eval_interval=10", "training.eval_batches=2",
        *overrides,
    ])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """Two trained tiny runs: the plain model in FP32 and the unit-scaled one in FP8 AMAX."""
    root = tmp_path_factory.mktemp("runs")
    result = {}
    for regime in ("fp32", "unit-fp8-amax"):
        train(regime_config(tiny_config(), regime), root / regime, quiet=True)
        result[regime] = root / regime
    return result


def final_val_loss(run_dir: Path) -> float:
    rows = [row for row in read_metrics(run_dir) if row["val_loss"]]
    return float(rows[-1]["val_loss"])


# ---------------------------------------------------------------------------------- evaluate


@pytest.mark.parametrize("regime, precision", [("fp32", "fp32"), ("unit-fp8-amax", "fp8-amax")])
def test_evaluation_in_the_trained_precision_is_the_final_validation_loss(runs, regime,
                                                                           precision):
    evaluation = evaluate_run(open_run(runs[regime]), [precision])
    # exactly: the same windows, the same weights, the same loss rule as the training loop
    assert evaluation.rows[0].loss == final_val_loss(runs[regime])
    assert evaluation.trained_precision == precision


def test_evaluation_table_has_every_precision_and_its_gap_to_fp32(runs, tmp_path):
    evaluation = evaluate_run(open_run(runs["fp32"]), scale_report=True)
    assert [row.precision for row in evaluation.rows] == list(PRECISIONS)
    losses = {row.precision: row.loss for row in evaluation.rows}
    assert all(math.isfinite(loss) for loss in losses.values())
    assert losses["fp8-amax"] != losses["fp32"]  # the casts really happened
    for row in evaluation.rows:
        assert row.gap_to_fp32 == row.loss - losses["fp32"]
        assert row.gap_to_fp32_percent == pytest.approx(100 * row.gap_to_fp32 / losses["fp32"])
        # the scale report: FP8 only, activations and weights at inference (no gradients)
        roles = [stats.role for stats in row.scale_report]
        assert roles == (["activation", "weight"] if row.precision.startswith("fp8") else [])
    static = {s.role: s for s in evaluation.rows[2].scale_report}
    amax = {s.role: s for s in evaluation.rows[3].scale_report}
    # a plain model's small weights underflow without a scale and not with AMAX scaling
    assert static["weight"].underflow > amax["weight"].underflow
    table = format_evaluation(evaluation)
    assert "| fp32 (trained) |" in table and "| fp8-static | weight |" in table
    markdown, data = write_evaluation(evaluation, tmp_path)
    assert markdown.read_text(encoding="utf-8") == table + "\n" and data.stat().st_size


def test_evaluation_on_a_text_file_predicts_each_character_once(runs, tmp_path):
    run = open_run(runs["unit-fp8-amax"])
    text = embedded_corpus()[:1000]
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    evaluation = evaluate_run(run, ["fp32"], str(path))
    assert evaluation.tokens == len(text) - 1 and math.isfinite(evaluation.rows[0].loss)
    path.write_text(text + "é€", encoding="utf-8")
    with pytest.raises(DataError, match=r"2 character\(s\) .*'é' \(1x\), '€' \(1x\)"):
        evaluate_run(run, ["fp32"], str(path))


def test_text_batches_cover_the_text_and_mean_loss_weights_uneven_batches():
    ids = torch.arange(50) % 7
    batches = text_batches(ids, seq_len=8, batch_size=4)
    assert [tuple(x.shape) for x, _ in batches] == [(4, 8), (2, 8), (1, 1)]
    labels = torch.cat([y.flatten() for _, y in batches])
    assert torch.equal(labels, ids[1:])  # every character but the first, once, in order
    inputs = torch.cat([x.flatten() for x, _ in batches])
    assert torch.equal(inputs, ids[:-1])
    loss = mean_loss(lambda x, y: y.float().mean(), batches)  # a "loss" per batch
    assert loss == pytest.approx(float(ids[1:].float().mean()))


def test_a_run_without_a_checkpoint_or_with_changed_data_is_refused(runs, tmp_path):
    with pytest.raises(RunError, match="cannot evaluate .*nothing: no such directory"):
        open_run(tmp_path / "nothing")
    with pytest.raises(RunError, match="cannot sample .*: it holds no checkpoint.pt"):
        open_run(tmp_path, "sample")
    run = open_run(runs["fp32"])
    path = tmp_path / "other.txt"
    path.write_text(embedded_corpus()[:5000], encoding="utf-8")
    changed = TrainedRun(run.run_dir, replace(run.config, data=replace(run.config.data,
                                                                       path=str(path))),
                         run.tokenizer, run.checkpoint)
    with pytest.raises(RunError, match="has changed since"):
        evaluate_run(changed, ["fp32"])


def test_precision_config_changes_only_the_casts():
    config = tiny_config()
    fp8 = precision_config(config, "fp8-static")
    assert (fp8.precision.dtype, fp8.precision.fp8.scaling) == ("fp8", "static")
    assert fp8.model == config.model and config.precision.fp8.scaling == "amax"
    with pytest.raises(ValueError, match="allowed: fp32, fp16, fp8-static, fp8-amax"):
        precision_config(config, "bf16")


# ---------------------------------------------------------------------------------- sample


def test_sampling_is_deterministic_for_a_seed(runs):
    run = open_run(runs["unit-fp8-amax"])
    first = sample_run(run, "def ", 40, seed=3)
    assert len(first) == 40 and set(first) <= set(run.tokenizer.chars)
    assert sample_run(run, "def ", 40, seed=3) == first
    assert sample_run(run, "def ", 40, seed=4) != first
    streamed: List[str] = []
    assert sample_run(run, "def ", 40, seed=3, on_text=streamed.append) == first
    assert "".join(streamed) == first


def test_sampling_through_the_traced_graph_writes_the_same_text(runs):
    # The emulator runs the graph PopTorch would compile: no host reads inside the forward.
    run = open_run(runs["unit-fp8-amax"])
    eager = sample_run(run, "x = ", 20, seed=0, precision="fp8-amax")
    assert sample_run(run, "x = ", 20, seed=0, precision="fp8-amax", backend="emulator") == eager


def test_sampling_refuses_prompts_the_tokenizer_cannot_encode(runs):
    run = open_run(runs["fp32"])
    with pytest.raises(DataError, match=r"the prompt has 2 character\(s\).*'é' \(2x\), '☃'"):
        sample_run(run, "café é ☃", 5)
    with pytest.raises(DataError, match="the prompt is empty"):
        sample_run(run, "", 5)


def test_generation_slides_one_window_along_the_text():
    seq_len, vocab = 6, 5
    seen: List[torch.Tensor] = []

    def runner(window: torch.Tensor) -> torch.Tensor:
        seen.append(window.clone())
        # always most likely: the token after the last real one, (last + 1) mod vocab
        logits = torch.zeros(*window.shape, vocab)
        logits[..., :] = -10.0
        nxt = (window + 1) % vocab
        return logits.scatter(-1, nxt[..., None], 10.0)

    drawn = generate(runner, [0, 1], 12, seq_len, temperature=0)
    assert drawn == [(2 + i) % vocab for i in range(12)]
    text = [0, 1] + drawn
    for step, window in enumerate(seen):
        assert window.shape == (1, seq_len)  # the same shape every call: memory of one window
        context = text[:2 + step][-seq_len:]
        assert window[0, :len(context)].tolist() == context
    assert generate(runner, [0, 1], 12, seq_len, temperature=1.0, top_k=1, seed=5) == drawn


def test_encode_known_passes_known_text():
    tokenizer = CharTokenizer.from_text("abc")
    assert encode_known(tokenizer, "cab", "x").tolist() == [2, 0, 1]


# ---------------------------------------------------------------------------- Hugging Face


def test_fp8_amax_inference_on_a_hugging_face_causal_lm():
    transformers = pytest.importorskip("transformers")
    if not transformers.utils.is_torch_available():
        # transformers 5 turns its PyTorch models off below torch 2.6 (the SDK's torch is 2.0.1).
        pytest.skip(f"transformers {transformers.__version__} has no PyTorch Llama for torch "
                    f"{torch.__version__}")
    text = embedded_corpus()[:60000]
    tokenizer = CharTokenizer.from_text(text)
    ids = tokenizer.encode(text)
    train_ids, val_ids = ids[:54000], ids[54000:]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config)
    loss_of = LanguageModelLoss(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(60):
            inputs, labels = get_batch(train_ids, 16, 32, generator)
            loss = loss_of(inputs, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    val_generator = torch.Generator().manual_seed(1)
    batches = [get_batch(val_ids, 16, 32, val_generator) for _ in range(4)]
    model.eval()
    with torch.no_grad():
        fp32 = mean_loss(loss_of, batches)
        converted = simulate_fp8(copy.deepcopy(model), FP8Config(scaling="amax"))
        fp8 = mean_loss(LanguageModelLoss(converted), batches)
    # every projection of every layer and the head: 2 x (q, k, v, o, gate, up, down) + 1
    assert sum(isinstance(m, FP8Linear) for m in converted.modules()) == 15
    assert fp32 < math.log(tokenizer.vocab_size) - 1.0  # it learnt something
    assert fp8 != fp32  # the casts changed the numbers ...
    assert math.exp(fp8) == pytest.approx(math.exp(fp32), rel=0.01)  # ... not the perplexity


# ---------------------------------------------------------------------------------- the CLI


def test_cli_evaluate_prints_and_writes_the_table(runs, tmp_path, capsys):
    run_dir = runs["unit-fp8-amax"]
    assert main(["evaluate", str(run_dir), "--precision", "fp32", "fp8-amax",
                 "--scale-report", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "| fp8-amax (trained) |" in out and "| fp8-amax | activation |" in out
    data = json.loads((tmp_path / "out" / "evaluate.json").read_text(encoding="utf-8"))
    assert [row["precision"] for row in data["rows"]] == ["fp32", "fp8-amax"]
    assert data["rows"][1]["loss"] == final_val_loss(run_dir)  # exact through JSON too
    assert (tmp_path / "out" / "evaluate.md").read_text(encoding="utf-8") in out
    assert PRECISION_NAMES == tuple(PRECISIONS)


def test_cli_sample_is_deterministic_and_refuses_bad_prompts_in_one_line(runs, capsys):
    args = ["sample", str(runs["fp32"]), "--prompt", "for ", "--tokens", "30", "--seed", "7",
            "--top-k", "5", "--temperature", "0.8"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first
    assert first.startswith("for ") and len(first.rstrip("\n")) >= 34
    for extra in (["--prompt", "naïve"], ["--prompt", ""], ["--temperature", "nan"],
                  ["--tokens", "0"], ["--precision", "bf16"]):
        assert main(["sample", str(runs["fp32"])] + extra) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1
    assert main(["evaluate", str(runs["fp32"]), "--precision", "fp32", "fp32"]) == 2
    assert main(["evaluate", str(runs["fp32"] / "missing")]) == 2
    assert "cannot evaluate" in capsys.readouterr().err


# ------------------------------------------------------------------------------ on PopTorch


@pytest.mark.ipu
def test_poptorch_inference_model_evaluates_and_samples_like_the_emulator(runs):
    pytest.importorskip("poptorch")
    backend = select_backend("ipu_model")  # IPU_UNIT_SCALING_BACKEND=ipu: on hardware
    run = open_run(runs["unit-fp8-amax"])
    on_ipu = evaluate_run(run, ["fp32", "fp8-amax"], backend=backend)
    emulated = evaluate_run(run, ["fp32", "fp8-amax"], backend="emulator")
    for ipu_row, emulated_row, tolerance in zip(on_ipu.rows, emulated.rows, (1e-4, 2e-2)):
        assert ipu_row.loss == pytest.approx(emulated_row.loss, rel=tolerance)
    text = sample_run(run, "def ", 10, seed=0, precision="fp8-amax", backend=backend)
    assert len(text) == 10 and set(text) <= set(run.tokenizer.chars)


def test_mean_loss_builds_no_autograd_graph():
    """Validation and evaluate hold one batch's activations at a time: no graph is recorded,
    whatever the caller's grad mode."""
    weight = torch.ones(3, requires_grad=True)
    modes: List[bool] = []

    def run(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        modes.append(torch.is_grad_enabled())
        return (inputs.float() * weight).mean()

    batches = [(torch.ones(2, 3), torch.zeros(2, 3)) for _ in range(2)]
    assert torch.is_grad_enabled()
    assert mean_loss(run, batches) == pytest.approx(1.0)
    assert modes == [False, False] and weight.grad is None


@pytest.mark.parametrize("recipe", ["mx", "block"])
def test_cli_evaluate_of_a_recipe_run_has_its_own_row(recipe, tmp_path, capsys):
    run_dir = tmp_path / recipe
    train(tiny_config(f"precision.fp8.scaling={recipe}", "training.steps=2"), run_dir,
          quiet=True)
    assert main(["evaluate", str(run_dir), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"| fp8-{recipe} (trained) |" in out
    data = json.loads((run_dir / "evaluate.json").read_text(encoding="utf-8"))
    assert [row["precision"] for row in data["rows"]] == [*PRECISION_NAMES, f"fp8-{recipe}"]
    assert data["rows"][-1]["loss"] == final_val_loss(run_dir)  # the same casts, same batches
    assert main(["evaluate", str(run_dir), "--precision", f"fp8-{recipe}", "--quiet"]) == 0
    capsys.readouterr()
    other = "fp8-rowwise"
    assert main(["evaluate", str(run_dir), "--precision", other]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"trained in fp8-{recipe}; allowed: fp32" in err, err
