"""Every config key reaches the code it names: changing it changes what a run does.

One row per key of the schema (the test fails when a key is added without a row): the value to
change it to, and what to observe. Keys that shape training are observed through ``train`` itself
(the losses it writes); keys that only an IPU reads through the PopTorch options or the stage
split that the training model gets; the others where they act.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from helpers import ONE_IPU

import ipu_unit_scaling.training.plots
from ipu_unit_scaling.apps import cli, compare
from ipu_unit_scaling.backends import BackendError, build_training_model, make_optimizer
from ipu_unit_scaling.loop import run_session
from ipu_unit_scaling.loop import training_loop as train_module
from ipu_unit_scaling.loop.training_loop import train
from ipu_unit_scaling.training.data import DataError
from ipu_unit_scaling.training.precision import build_model, regime_config
from ipu_unit_scaling.training.run_config import Config, load_config
from ipu_unit_scaling.training.run_records import read_metrics, save_checkpoint

BASE = [*ONE_IPU,
        "training.steps=4", "training.eval_interval=4", "training.eval_batches=1",
        "training.warmup_steps=0", "training.log_interval=1"]


TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(80))
DATA: List[str] = []  # a small text file: a short run need not encode the embedded corpus


@pytest.fixture(autouse=True, scope="module")
def small_text(tmp_path_factory: Any) -> None:
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(TEXT)
    DATA[:] = [f"data.path={path}"]


def _config(*overrides: str) -> Config:
    return load_config("tiny", BASE + DATA + list(overrides))


def _losses(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> List[Any]:
    """What a short ``train`` of the config writes: every step's losses, and how many."""
    run_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    train(_config(*overrides), run_dir, quiet=True)
    return [(row["step"], row["train_loss"], row["val_loss"]) for row in read_metrics(run_dir)]


def _casts(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> List[Any]:
    """The FP8 casts a short ``train`` makes: site, format and scale of each. (Power-of-two
    scaling makes formats that differ only in range, and margins, often lose the same bits.)"""
    from ipu_unit_scaling.fp8 import fp8_stats

    with fp8_stats() as stats:
        _losses(tmp_path, monkeypatch, overrides)
    return [(r.site, r.format, r.log2_scale) for r in stats.records]


def _log_lines(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> List[str]:
    lines: List[str] = []
    run_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    train(_config(*overrides), run_dir, log=lines.append)
    return [line for line in lines if "loss" in line]


def _checkpoints_written(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> List[int]:
    saves: List[int] = []
    real = save_checkpoint
    monkeypatch.setattr(run_session, "save_checkpoint",
                        lambda path, state: (saves.append(state["step"]), real(path, state)))
    _losses(tmp_path, monkeypatch, overrides)
    monkeypatch.setattr(run_session, "save_checkpoint", real)
    return saves


def _stages(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> Any:
    config = _config(*overrides)
    model = build_model(config)
    wrapper = build_training_model(model, make_optimizer(model.parameters(), config, "cpu"),
                                   config, "cpu")
    return wrapper.stages


def _options(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> Any:
    from ipu_unit_scaling.backends.poptorch.poptorch_options import option_calls

    return option_calls(_config(*overrides).ipu)


def _overflow_behaviour(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> Any:
    """Loss of the run's model with weights far beyond FP8's range, static scaling."""
    config = _config("precision.fp8.scaling=static", *overrides)
    torch.manual_seed(0)
    model = build_model(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1e4)
    ids = torch.randint(0, config.model.vocab_size, (2, config.model.seq_len))
    try:
        return float(model(ids, ids).detach())
    except Exception as error:  # NaN meeting a later cast
        return type(error).__name__


def _amax_history(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> Any:
    """The delayed recipe's history of the model's first FP8 layer after an input 1000 times
    larger than the next: its shape, and the input scale it gives."""
    from ipu_unit_scaling.fp8 import FP8Linear
    from ipu_unit_scaling.fp8.recipe_linear import delayed_log2_scale

    config = _config(*overrides)
    torch.manual_seed(0)
    layer = next(m for m in build_model(config).modules() if isinstance(m, FP8Linear))
    x = torch.randn(4, layer.in_features)
    layer(x * 1000.0)
    layer(x)
    history = layer.amax_history
    return tuple(history.shape), delayed_log2_scale(history, config.precision.fp8, "input")


def _wide_row_output(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> Any:
    """The model's first FP8 layer on rows whose first element is 2**20 times the others: what
    the other elements keep depends on which of them share its scale."""
    from ipu_unit_scaling.fp8 import FP8Linear

    torch.manual_seed(0)
    layer = next(m for m in build_model(_config(*overrides)).modules()
                 if isinstance(m, FP8Linear))
    x = torch.randn(4, layer.in_features)
    x[:, 0] = 2.0**20
    return layer(x).tolist()


def _refusal(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> Any:
    try:
        return _losses(tmp_path, monkeypatch, overrides)
    except (DataError, BackendError) as error:
        return type(error).__name__


def _default_run_dir(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> Any:
    seen: Dict[str, Path] = {}

    def fake_train(config: Any, run_dir: Path, **kwargs: Any) -> Any:
        seen["run_dir"] = Path(run_dir)
        raise cli.UsageError("stop here")

    monkeypatch.setattr(train_module, "train", fake_train)  # the CLI imports it when it runs
    cli.main(["train", "--config", "tiny", "--quiet", "--set", *BASE, *DATA, *overrides])
    monkeypatch.setattr(train_module, "train", train)
    return seen["run_dir"].parent


def _compare_regimes(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> Any:
    seen: Dict[str, Any] = {}

    def fake_compare(config: Any, regimes: Any, run_dir: Path, quiet: bool = False,
                     **_: Any) -> Any:
        seen["regimes"] = list(regimes)
        raise cli.UsageError("stop here")

    monkeypatch.setattr(compare, "run_compare", fake_compare)
    cli.main(["compare", "--config", "tiny", "--run-dir", str(tmp_path / "c"), "--set",
              *BASE, *DATA, *overrides])
    return seen["regimes"]


def _compare_rates(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> Any:
    config = _config(*overrides)
    return [regime_config(config, regime).training.learning_rate for regime in
            ("fp32", "unit-fp8")]


def _data_source(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> Any:
    run_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    summary = train(_config(*overrides), run_dir, quiet=True)
    return summary.data, summary.unigram_baseline


def _telemetry_steps(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> Any:
    run_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    train(_config(*overrides), run_dir, quiet=True)
    from ipu_unit_scaling.training.telemetry_log import read_telemetry

    return sorted({row["step"] for row in read_telemetry(run_dir / "telemetry.csv")})


def _warning_kinds(tmp_path: Path, monkeypatch: Any, overrides: List[str]) -> Any:
    """The warnings the run's health monitor raises on rows each a little inside the default
    thresholds."""
    from ipu_unit_scaling.training.run_health import HealthMonitor

    monitor = HealthMonitor(_config(*overrides).telemetry)
    rows = [dict(step=1, kind="cast", site="a.input", role="activation", format="F143",
                 log2_scale=0, rms=60.0, flushed_fraction=0.05, saturated_fraction=0.0005),
            dict(step=1, kind="attention", site="att", amax=50.0)]
    rows += [dict(step=1, kind="param", site=f"w{i}", role="hidden", update_ratio=ratio)
             for i, ratio in enumerate((0.03, 0.03, 0.03, 0.2))]
    losses = [[dict(step=s, kind="loss", site="loss", amax=2.0 if s < 11 else 2.4)]
              for s in range(1, 12)]
    return sorted((w["site"], w["role"]) for step in [rows, *losses]
                  for w in monitor.check(step))


PIPELINE = ["ipu.ipus_per_replica=2", "ipu.layers_per_ipu=[1, 1]", "ipu.gradient_accumulation=4"]
# key -> (the new value, or the overrides that change it; what to observe; settings both
# observations share)
KEYS: Dict[str, Any] = {
    "model.vocab_size": ("10", _refusal, []),  # an upper bound: below the corpus's, refused
    "model.seq_len": ("8", _losses, []),
    "model.depth": ("1", _losses, []),
    "model.hidden_size": ("16", _losses, []),
    "model.heads": ("4", _losses, []),
    "model.mlp_expansion": ("2", _losses, []),
    "model.dropout": ("0.5", _losses, []),
    "model.unit_scaled": ("false", _losses, []),
    "model.attn_tau": ("0.7", _losses, []),
    "model.mlp_tau": ("0.9", _losses, []),
    "model.bias": ("true", _losses, []),
    "model.parametrization": ("u-mup", _losses, []),
    # u-μP's multipliers act only under u-mup (elsewhere they are refused)
    "model.residual_mult": ("0.5", _losses, ["model.parametrization=u-mup"]),
    "model.residual_attn_ratio": ("0.5", _losses, ["model.parametrization=u-mup"]),
    "model.attn_softmax_mult": ("4", _losses, ["model.parametrization=u-mup"]),
    "model.ffn_act_mult": ("2", _losses, ["model.parametrization=u-mup"]),
    "model.loss_softmax_mult": ("2", _losses, ["model.parametrization=u-mup"]),
    "model.factory": ("examples.library_decoder:build", _losses, []),
    "model.umup_hidden_constraint": ("to_output_scale", _losses, ["model.parametrization=u-mup"]),
    "model.umup_attention_scaling": ("per-row", _losses, ["model.parametrization=u-mup"]),
    "model.umup_gelu_constraint": ("gmean", _losses, ["model.parametrization=u-mup"]),
    "precision.dtype": ("fp32", _losses, []),
    "precision.fp8.activation_format": ("E4M3FN", _casts, []),
    "precision.fp8.weight_format": ("E4M3FN", _casts, []),
    "precision.fp8.gradient_format": ("E5M2", _casts, []),
    "precision.fp8.scaling": ("static", _losses, []),
    "precision.fp8.activation_margin": ("4", _casts, []),
    "precision.fp8.weight_margin": ("4", _casts, []),
    "precision.fp8.gradient_margin": ("0", _casts, []),
    "precision.fp8.rounding": ("stochastic", _losses, []),
    "precision.fp8.overflow": ("nan", _overflow_behaviour, []),
    "precision.fp8.attention": ("true", _losses, []),
    "precision.fp8.amax_history_length": ("4", _amax_history, ["precision.fp8.scaling=delayed"]),
    "precision.fp8.amax_reduction": ("most_recent", _amax_history,
                                     ["precision.fp8.scaling=delayed"]),
    "precision.fp8.block_size": ("8", _wide_row_output, ["precision.fp8.scaling=block"]),
    "precision.fp8.scale_rounding": ("up", _losses, ["precision.fp8.scaling=mx"]),
    "precision.fp8.grad_weight_high_precision": ("true", _losses,
                                                 ["precision.fp8.scaling=rowwise"]),
    # (the layers must be spread over the new IPU count too)
    "ipu.ipus_per_replica": (["ipu.ipus_per_replica=2", "ipu.layers_per_ipu=[-1, -1]"],
                             _stages, ["ipu.gradient_accumulation=4"]),
    "ipu.layers_per_ipu": ("[2, 0]", _stages, PIPELINE),
    "ipu.device_iterations": ("2", _losses, []),
    "ipu.gradient_accumulation": ("2", _losses, []),
    "ipu.replication_factor": ("2", _losses, []),
    "ipu.available_memory_proportion": ("0.5", _options, []),
    "ipu.partials_type": ("half", _options, []),
    "ipu.stochastic_rounding": ("true", _options, []),
    "ipu.executable_cache_dir": ("cache", _options, []),
    "ipu.auto_round_num_ipus": ("true", _options, []),
    "training.batch_size": ("4", _losses, []),
    "training.steps": ("2", _losses, []),
    "training.optimizer": ("sgd", _losses, []),
    "training.learning_rate": ("0.01", _losses, []),
    "training.weight_decay": ("0.5", _losses, []),
    "training.schedule": ("constant", _losses, []),
    "training.warmup_steps": ("3", _losses, []),
    "training.grad_clip": ("0.001", _losses, []),
    "training.seed": ("1", _losses, []),
    "training.log_interval": ("2", _log_lines, []),
    "training.eval_interval": ("1", _losses, []),
    "training.eval_batches": ("2", _losses, []),
    "training.checkpoint_dir": (None, _default_run_dir, []),  # a folder in tmp_path
    "training.checkpoint_interval": ("1", _checkpoints_written, []),
    "data.path": (None, _data_source, []),  # a file in tmp_path
    "data.val_fraction": ("0.3", _losses, []),
    "compare.regimes": ("[fp32]", _compare_regimes, []),
    "compare.learning_rates": ("{fp32: 0.5, unit-fp8: 0.25}", _compare_rates, []),
    "backend": ("ipu", _refusal, []),  # never quietly the CPU when an IPU is asked for
    "telemetry.interval": ("3", _telemetry_steps, []),
    "telemetry.flushed_warning": ("0.01", _warning_kinds, []),
    "telemetry.saturated_warning": ("0.0001", _warning_kinds, []),
    "telemetry.range_margin": ("3", _warning_kinds, []),
    "telemetry.update_ratio_spread": ("2", _warning_kinds, []),
    "telemetry.update_ratio_max": ("0.1", _warning_kinds, []),
    "telemetry.attention_logit_max": ("40", _warning_kinds, []),
    "telemetry.loss_spike": ("0.1", _warning_kinds, []),
}


def _schema_keys() -> List[str]:
    keys = []
    for section, value in Config().to_dict().items():
        if not isinstance(value, dict):
            keys.append(section)
            continue
        for key, inner in value.items():
            if isinstance(inner, dict) and section == "precision":
                keys += [f"{section}.{key}.{name}" for name in inner]
            else:
                keys.append(f"{section}.{key}")
    return keys


def test_every_key_of_the_schema_has_a_row():
    assert sorted(KEYS) == sorted(_schema_keys())


@pytest.mark.parametrize("key", sorted(KEYS))
def test_changing_the_key_changes_what_happens(key, tmp_path, monkeypatch):
    monkeypatch.setattr(ipu_unit_scaling.training.plots, "plot_run", lambda *args, **kwargs: None)
    value, observe, shared = KEYS[key]
    if key == "training.checkpoint_dir":
        value = str(tmp_path / "elsewhere")
        monkeypatch.chdir(tmp_path)
    if key == "data.path":
        text = tmp_path / "text.txt"
        text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
        value = str(text)
    change = value if isinstance(value, list) else [f"{key}={value}"]
    before = observe(tmp_path, monkeypatch, list(shared))
    after = observe(tmp_path, monkeypatch, list(shared) + change)
    assert before != after, f"{key}={value} changed nothing: {after}"


def test_model_keys_reach_the_modules():
    """The three keys the training loop used to drop, seen on the built model itself."""
    model = build_model(_config("model.bias=true", "model.attn_tau=0.7", "model.mlp_tau=0.9"))
    layer = model.layers[0]  # type: ignore[index]
    assert (layer.attn_tau, layer.mlp_tau) == (0.7, 0.9)
    assert layer.mlp.up.bias is not None and layer.attn.qkv.bias is not None
    default = build_model(_config()).layers[0]  # type: ignore[index]
    assert (default.attn_tau, default.mlp_tau, default.mlp.up.bias) == (0.2, 0.5, None)
