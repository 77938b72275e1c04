"""Masked-language-model training of the BERT-style encoder, and the precision comparison
behind ``ipu-unit-scaling compare --model bert``: the unit-scaling paper's BERT experiment at a
size a CPU trains in minutes.

Data: the character corpus (see `data`), cut into sequences of random length between
`min_len` and `seq_len`, padded to `seq_len` with a padding token; BERT's masking picks 15% of
the real tokens as targets (at least one per sequence), of which 80% are replaced by a mask
token, 10% by a random character and 10% kept. The loss and the metrics count the targets
only: validation MLM loss (mean cross-entropy per target) and accuracy (targets predicted
exactly), on fixed validation batches.

Every regime trains the same batches from the same seed; a run is one regime and one seed, in
its own directory (`metrics.csv`, `summary.json`); finished runs are reused when the
comparison is run again into the same directory.
"""
from __future__ import annotations

import copy
import csv
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import modules as uu
from .data import load_corpus
from .encoder import BertStyleEncoder
from .fp8 import NonFiniteAmaxError
from .precision import REGIME_SETTINGS

__all__ = [
    "MLMConfig", "MLMBatches", "mask_tokens", "build_encoder", "train_mlm", "run_mlm_compare",
    "format_mlm_table", "check_mlm_regimes", "encoder_kind", "MLM_REGIMES",
    "MLM_ALLOWED_REGIMES", "ENCODER_OPS",
]

# The encoder's model kinds (precision.MODEL_KINDS less u-μP, which it has no form of).
ENCODER_OPS = {"plain": uu.TORCH_OPS, "unit": uu.UNIT_OPS}
ENCODER_NAMES = {"plain": "plain", "unit": "unit-scaled"}
# Every regime of a kind the encoder has.
MLM_ALLOWED_REGIMES = tuple(regime for regime, (kind, _, _) in REGIME_SETTINGS.items()
                            if kind in ENCODER_OPS)
# The comparison the paper's BERT experiment makes (more regimes may be asked for).
MLM_REGIMES = ("fp32", "fp16", "fp8-naive", "unit-fp16", "unit-fp8")
# Per model kind: the best of a sweep of its fp32 regime at the default shape, seed 0 (plain:
# 1e-3, 2e-3, 4e-3; unit-scaled: 0.01, 0.02, 0.04, 0.08); see the README.
KIND_LEARNING_RATES = {"plain": 2e-3, "unit": 0.04}


def encoder_kind(regime: str) -> str:
    """``plain`` or ``unit``: the encoder a regime trains; ValueError for others."""
    check_mlm_regimes([regime])
    return REGIME_SETTINGS[regime][0]


def check_mlm_regimes(regimes: Sequence[str]) -> None:
    """ValueError naming the regimes the encoder cannot run (unknown ones, u-μP)."""
    refused = [regime for regime in regimes if regime not in MLM_ALLOWED_REGIMES]
    if refused:
        raise ValueError(f"--model bert cannot run {', '.join(refused)} (the BERT-style encoder "
                         f"is plain or unit-scaled, not u-μP); its regimes: "
                         f"{', '.join(MLM_ALLOWED_REGIMES)}")


def _default_learning_rates() -> Dict[str, float]:
    return {regime: KIND_LEARNING_RATES[encoder_kind(regime)] for regime in MLM_ALLOWED_REGIMES}


@dataclass
class MLMConfig:
    """Shape, data and training of the masked-LM comparison (``--set mlm.<field>=value``)."""

    hidden_size: int = 128
    depth: int = 2
    heads: int = 4
    mlp_expansion: int = 4
    seq_len: int = 64
    min_len: int = 24
    mask_prob: float = 0.15
    attn_tau: float = 0.2
    mlp_tau: float = 0.5
    batch_size: int = 16
    steps: int = 300
    warmup_steps: int = 30
    eval_interval: int = 100
    eval_batches: int = 8
    val_fraction: float = 0.1
    data: Optional[str] = None
    learning_rates: Dict[str, float] = field(default_factory=_default_learning_rates)

    def validate(self) -> None:
        problems = []
        if self.hidden_size % self.heads:
            problems.append(f"hidden_size {self.hidden_size} is not a multiple of heads "
                            f"{self.heads}")
        if not 1 <= self.min_len <= self.seq_len:
            problems.append(f"min_len must be in [1, seq_len={self.seq_len}], got "
                            f"{self.min_len}")
        if not 0 < self.mask_prob < 1:
            problems.append(f"mask_prob must be in (0, 1), got {self.mask_prob}")
        for name in ("depth", "heads", "batch_size", "steps", "eval_batches", "hidden_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if problems:
            raise ValueError("invalid mlm config: " + "; ".join(problems))

    def with_overrides(self, overrides: Sequence[str]) -> MLMConfig:
        """A copy with ``mlm.<field>=<value>`` (or ``<field>=<value>``) overrides applied."""
        from .config import parse_override_value

        result = copy.deepcopy(self)
        known = {f.name for f in fields(self)}
        for item in overrides:
            key, sep, text = item.partition("=")
            key = key[len("mlm."):] if key.startswith("mlm.") else key
            if not sep or key.split(".")[0] not in known:
                raise ValueError(f"{item!r}: not an mlm setting; known: {', '.join(sorted(known))}")
            value = parse_override_value(item.partition("=")[0], text)
            if key.startswith("learning_rates."):
                regime = key.split(".", 1)[1]
                check_mlm_regimes([regime])
                result.learning_rates[regime] = float(value)
            else:
                current = getattr(result, key)
                if current is not None and not isinstance(value, type(current)) and not (
                        isinstance(current, float) and isinstance(value, int)):
                    raise ValueError(f"{item!r}: expected {type(current).__name__}")
                setattr(result, key, float(value) if isinstance(current, float) else value)
        result.validate()
        return result


# ---------------------------------------------------------------- data


def mask_tokens(ids: Tensor, real: Tensor, mask_id: int, vocab: int, mask_prob: float,
                generator: torch.Generator) -> Tuple[Tensor, Tensor]:
    """BERT's masking of the real (unpadded) positions: (inputs, labels), labels -100 off target.

    Each real token is a target with probability `mask_prob`, and every sequence gets at least
    one; a target's input becomes `mask_id` (80%), a random token below `vocab` (10%) or stays
    (10%).
    """
    chosen = (torch.rand(ids.shape, generator=generator) < mask_prob) & real
    first = real.float().argmax(dim=1)  # a real position of each row, for rows without a target
    none = ~chosen.any(dim=1)
    chosen[none, first[none]] = True
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    kind = torch.rand(ids.shape, generator=generator)
    random_tokens = torch.randint(0, vocab, ids.shape, generator=generator)
    inputs = torch.where(chosen & (kind < 0.8), torch.full_like(ids, mask_id), ids)
    inputs = torch.where(chosen & (kind >= 0.8) & (kind < 0.9), random_tokens, inputs)
    return inputs, labels


class MLMBatches:
    """Padded, masked batches of one text split, from a seeded generator."""

    def __init__(self, tokens: Tensor, vocab: int, config: MLMConfig, seed: int) -> None:
        self.tokens, self.vocab, self.config = tokens, vocab, config
        self.pad_id, self.mask_id = vocab, vocab + 1
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> Tuple[Tensor, Tensor]:
        c, g = self.config, self.generator
        starts = torch.randint(0, len(self.tokens) - c.seq_len, (c.batch_size,), generator=g)
        ids = self.tokens[starts[:, None] + torch.arange(c.seq_len)]
        lengths = torch.randint(c.min_len, c.seq_len + 1, (c.batch_size,), generator=g)
        real = torch.arange(c.seq_len)[None, :] < lengths[:, None]
        ids = torch.where(real, ids, torch.full_like(ids, self.pad_id))
        return mask_tokens(ids, real, self.mask_id, self.vocab, c.mask_prob, g)


# ---------------------------------------------------------------- models and regimes


def build_encoder(config: MLMConfig, vocab: int, regime: str) -> nn.Module:
    """The encoder for one regime: unit-scaled or plain, with its precision simulated."""
    from .precision import simulate_fp16

    kind = encoder_kind(regime)
    _, dtype, scaling = REGIME_SETTINGS[regime]
    model: nn.Module = BertStyleEncoder(
        vocab + 2, config.hidden_size, config.depth, config.heads, config.seq_len, pad_id=vocab,
        mlp_expansion=config.mlp_expansion, attn_tau=config.attn_tau, mlp_tau=config.mlp_tau,
        ops=ENCODER_OPS[kind],
    )
    if dtype == "fp8":
        from .fp8 import FP8Config, simulate_fp8

        model = simulate_fp8(model, FP8Config(scaling=scaling))
    elif dtype == "fp16":
        model = simulate_fp16(model)
    return model


def _learning_rate(config: MLMConfig, peak: float, step: int) -> float:
    if step < config.warmup_steps:
        return peak * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps))
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def evaluate(model: nn.Module, batches: Sequence[Tuple[Tensor, Tensor]]) -> Tuple[float, float]:
    """(MLM loss per target, accuracy over targets) on `batches`."""
    was_training = model.training
    model.eval()
    total_loss, correct, targets = 0.0, 0, 0
    try:
        with torch.no_grad():
            for inputs, labels in batches:
                loss, logits = model(inputs, labels, return_logits=True)
                counted = labels != -100
                total_loss += float(loss) * int(counted.sum())
                correct += int((logits.argmax(-1) == labels)[counted].sum())
                targets += int(counted.sum())
    except NonFiniteAmaxError:  # an FP8 cast that meets a non-finite value refuses it
        return math.nan, math.nan
    finally:
        model.train(was_training)
    return total_loss / targets, correct / targets


def train_mlm(config: MLMConfig, regime: str, seed: int, run_dir: Path,
              log: Callable[[str], None] = lambda text: None) -> Dict[str, Any]:
    """Train one regime with one seed into `run_dir`; returns (and writes) its summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(config.data, config.val_fraction, config.seq_len)
    vocab = corpus.tokenizer.vocab_size
    torch.manual_seed(seed)
    model = build_encoder(config, vocab, regime)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rates[regime])
    train_batches = MLMBatches(corpus.train, vocab, config, seed)
    val_source = MLMBatches(corpus.val, vocab, config, 10_000 + seed)
    val_batches = [val_source.next() for _ in range(config.eval_batches)]
    curve: List[Tuple[int, float, float]] = []
    status, message, step, started = "completed", "", 0, time.perf_counter()
    with open(run_dir / "metrics.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "lr", "train_loss", "val_loss", "val_accuracy"])
        while step < config.steps:
            lr = _learning_rate(config, config.learning_rates[regime], step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            inputs, labels = train_batches.next()
            try:
                loss = model(inputs, labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                value = loss.item()
            except NonFiniteAmaxError:
                value = math.nan
            step += 1
            row: List[Any] = [step, repr(lr), repr(value), "", ""]
            if not math.isfinite(value):
                status, message = "diverged", f"loss became {value} at step {step}"
                writer.writerow(row)
                break
            if step == config.steps or (config.eval_interval and step % config.eval_interval == 0):
                val_loss, accuracy = evaluate(model, val_batches)
                curve.append((step, val_loss, accuracy))
                row[3:] = [repr(val_loss), repr(accuracy)]
                log(f"{regime} seed {seed}: step {step}: MLM loss {val_loss:.4f}, "
                    f"accuracy {accuracy:.3f}")
            writer.writerow(row)
    final = curve[-1] if curve and status == "completed" else None
    summary = {
        "regime": regime, "model": encoder_kind(regime), "seed": seed, "status": status,
        "message": message, "steps": step,
        "final_val_loss": final[1] if final else None,
        "final_val_accuracy": final[2] if final else None,
        "elapsed_s": time.perf_counter() - started, "vocab": vocab,
        "learning_rate": config.learning_rates[regime], "val_curve": curve,
        "config": asdict(config),
    }
    with open(run_dir / "summary.json", "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
    return summary


# ---------------------------------------------------------------- the comparison


def _mean_std(values: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def run_mlm_compare(config: MLMConfig, regimes: Sequence[str], seeds: Sequence[int],
                    run_dir: Path, quiet: bool = False) -> List[Dict[str, Any]]:
    """Train every regime with every seed into `run_dir/<regime>-seed<k>`; one row per regime,
    over the seeds: mean (and std) final MLM loss and accuracy, and the gap to fp32."""
    check_mlm_regimes(regimes)
    say = (lambda text: None) if quiet else print
    run_dir.mkdir(parents=True, exist_ok=True)
    runs: Dict[Tuple[str, int], Dict[str, Any]] = {}
    for regime in regimes:
        for seed in seeds:
            directory = run_dir / f"{regime}-seed{seed}"
            previous = _read_json(directory / "summary.json")
            # A summary without the model kind may come from a build that trained every regime
            # unit-scaled: it is trained again.
            if previous and previous.get("config") == asdict(config) and \
                    previous.get("model") == encoder_kind(regime) and \
                    previous.get("status") in ("completed", "diverged"):
                say(f"{regime} seed {seed}: reusing the finished run in {directory}")
                runs[regime, seed] = previous
                continue
            runs[regime, seed] = train_mlm(config, regime, seed, directory, log=say)
    rows = []
    for regime in regimes:
        done = [runs[regime, s] for s in seeds]
        losses = [r["final_val_loss"] for r in done if r["status"] == "completed"]
        accuracy = [r["final_val_accuracy"] for r in done if r["status"] == "completed"]
        gaps = []
        for run in done:
            reference = runs.get(("fp32", run["seed"]))
            if run["status"] == "completed" and reference and reference["status"] == "completed":
                gaps.append(100 * (run["final_val_loss"] - reference["final_val_loss"])
                            / reference["final_val_loss"])
        loss_mean, loss_std = _mean_std(losses)
        accuracy_mean, accuracy_std = _mean_std(accuracy)
        gap_mean, gap_std = _mean_std(gaps)
        rows.append({
            "regime": regime, "model": encoder_kind(regime),
            "learning_rate": config.learning_rates[regime],
            "completed": len(losses), "runs": len(done),
            "val_loss": loss_mean, "val_loss_std": loss_std,
            "val_accuracy": accuracy_mean, "val_accuracy_std": accuracy_std,
            "gap_to_fp32_percent": gap_mean, "gap_std": gap_std,
            "seconds": statistics.fmean(r["elapsed_s"] for r in done),
            "messages": [r["message"] for r in done if r["message"]],
        })
    table = format_mlm_table(rows, seeds)
    (run_dir / "compare.md").write_text(table + "\n", encoding="utf-8")
    with open(run_dir / "compare.json", "w", encoding="utf-8") as handle:
        json.dump({"config": asdict(config), "seeds": list(seeds), "regimes": rows}, handle,
                  indent=2)
    try:
        from .plots import plot_compare

        curves = {f"{r}-seed{s}" if len(seeds) > 1 else r:
                  [(p[0], p[1]) for p in runs[r, s]["val_curve"]] for r in regimes for s in seeds}
        plot_compare(curves, run_dir / "compare.png", None,
                     title="Validation masked-LM loss by regime and seed")
    except RuntimeError:  # matplotlib missing: the table is the result
        pass
    return rows


def _read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _pm(mean: Optional[float], std: Optional[float], fmt: str, suffix: str = "") -> str:
    if mean is None:
        return "-"
    return f"{mean:{fmt}}{suffix} ± {std:{fmt.lstrip('+')}}{suffix}"


def format_mlm_table(rows: Sequence[Dict[str, Any]], seeds: Sequence[int]) -> str:
    """Markdown: one row per regime, mean ± std over the seeds."""
    lines = [
        "| regime | model | precision | learning rate | MLM loss | accuracy | gap to fp32 "
        "| completed | time per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        _, dtype, scaling = REGIME_SETTINGS[row["regime"]]
        precision = dtype if dtype != "fp8" else f"fp8 {scaling}"
        lines.append(
            f"| {row['regime']} | {ENCODER_NAMES[encoder_kind(row['regime'])]} | {precision} | "
            f"{row['learning_rate']:g} | {_pm(row['val_loss'], row['val_loss_std'], '.4f')} | "
            f"{_pm(row['val_accuracy'], row['val_accuracy_std'], '.3f')} | "
            f"{_pm(row['gap_to_fp32_percent'], row['gap_std'], '+.1f', '%')} | "
            f"{row['completed']}/{row['runs']} | {row['seconds']:.0f} s |"
        )
    lines.append("")
    lines.append(f"Mean ± standard deviation over seeds {', '.join(map(str, seeds))}; MLM loss "
                 "in nats per masked character on the validation split.")
    return "\n".join(lines)
