"""Which settings a resume may change (``train --resume RUN_DIR --set key=value``), key by key.

A resume continues one run: the weights, optimizer state, random streams and validation
windows the checkpoint holds or implies. A key that redefines any of them is *kept*: a resume
that asks for another value is refused, in one line, before anything in the run directory is
rewritten. The other keys steer the steps still to come (how long to train, the learning-rate
schedule, how often to log and checkpoint, where and how the same batches are laid out) and
*may change*. Every key of the config schema is classified here; a test fails for a key that is
not, and checks the table of the run-directories guide against :func:`policy_table`.

A resume that trains nothing (its checkpoint is at ``training.steps``) changes nothing either:
asking it for another value of any key is refused, so a finished run's record of how it was
trained is never rewritten.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

__all__ = ["MAY_CHANGE", "KEPT", "RESUME_RULES", "flat_settings", "resume_refusal",
           "policy_table"]

MAY_CHANGE = "may change"
KEPT = "kept"

_MODEL = "the model the checkpoint holds"
_ARITHMETIC = "the arithmetic the run trained in"
_LAYOUT = ("how the same global batch is laid out: a checkpoint resumes on any layout, with or "
           "without torchrun")

# key -> (may a resume change it, why)
RESUME_RULES: Dict[str, Tuple[str, str]] = {
    **{f"model.{key}": (KEPT, _MODEL) for key in (
        "vocab_size", "seq_len", "depth", "hidden_size", "heads", "mlp_expansion",
        "unit_scaled", "attn_tau", "mlp_tau", "bias", "parametrization", "residual_mult",
        "residual_attn_ratio", "attn_softmax_mult", "ffn_act_mult", "loss_softmax_mult",
        "factory", "umup_hidden_constraint", "umup_attention_scaling",
        "umup_gelu_constraint")},
    "model.dropout": (MAY_CHANGE, "shapes no weight and no op of the saved model (as when "
                                  "fine-tuning)"),
    "precision.dtype": (KEPT, _ARITHMETIC),
    **{f"precision.fp8.{key}": (KEPT, _ARITHMETIC) for key in (
        "activation_format", "weight_format", "gradient_format", "scaling",
        "activation_margin", "weight_margin", "gradient_margin", "rounding", "overflow",
        "attention", "amax_history_length", "amax_reduction", "block_size", "scale_rounding",
        "grad_weight_high_precision")},
    "ipu.ipus_per_replica": (MAY_CHANGE, _LAYOUT),
    "ipu.layers_per_ipu": (MAY_CHANGE, _LAYOUT),
    "ipu.replication_factor": (MAY_CHANGE, _LAYOUT),
    "ipu.gradient_accumulation": (MAY_CHANGE, _LAYOUT),
    "ipu.device_iterations": (MAY_CHANGE, "steps per call; the steps left must be a multiple "
                                          "of it"),
    "ipu.available_memory_proportion": (MAY_CHANGE, "memory planning on the IPU only"),
    "ipu.partials_type": (KEPT, _ARITHMETIC),
    "ipu.stochastic_rounding": (KEPT, _ARITHMETIC),
    "ipu.executable_cache_dir": (MAY_CHANGE, "where compiled IPU programs are cached"),
    "ipu.auto_round_num_ipus": (MAY_CHANGE, "how many IPUs are attached, not what they run"),
    "training.batch_size": (KEPT, "what one step is: the checkpoint's data position counts in "
                                  "it"),
    "training.steps": (MAY_CHANGE, "how long to train; not below the checkpoint's step"),
    "training.optimizer": (KEPT, "the optimizer state the checkpoint holds"),
    "training.learning_rate": (MAY_CHANGE, "the schedule of the steps to come (a resume says "
                                           "how the learning rate jumps)"),
    "training.weight_decay": (KEPT, "part of the optimizer state the checkpoint holds (a new "
                                    "value would be silently replaced by the saved one)"),
    "training.schedule": (MAY_CHANGE, "the schedule of the steps to come"),
    "training.warmup_steps": (MAY_CHANGE, "the schedule of the steps to come"),
    "training.grad_clip": (MAY_CHANGE, "a bound on the updates to come, like the learning "
                                       "rate"),
    "training.seed": (KEPT, "picks the validation windows; the random streams are the "
                            "checkpoint's"),
    "training.log_interval": (MAY_CHANGE, "how often progress is shown"),
    "training.eval_interval": (MAY_CHANGE, "when the steps to come are validated"),
    "training.eval_batches": (KEPT, "the validation windows every validation loss is taken on"),
    "training.checkpoint_dir": (MAY_CHANGE, "where new run directories go, not this one"),
    "training.checkpoint_interval": (MAY_CHANGE, "how often the steps to come are saved"),
    "data.path": (MAY_CHANGE, "where the text is: a resume checks it is the text the run "
                              "trained on (its SHA-256), so a moved file resumes"),
    "data.val_fraction": (KEPT, "the split between training and validation text"),
    "compare.regimes": (MAY_CHANGE, "read by compare, not by a run"),
    "compare.learning_rates": (MAY_CHANGE, "read by compare, not by a run"),
    "backend": (MAY_CHANGE, "where the steps run; the checkpoint is the same on every "
                            "backend"),
    **{f"telemetry.{key}": (MAY_CHANGE, "what the run records and warns of, not what it "
                                        "computes") for key in (
        "interval", "flushed_warning", "saturated_warning", "range_margin",
        "update_ratio_spread", "update_ratio_max", "attention_logit_max", "loss_spike")},
}

# Values that are settings as a whole, not sections.
_LEAF_MAPPINGS = ("compare.learning_rates",)


def flat_settings(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """A config's ``to_dict()`` as ``{"section.key": value}``."""
    flat: Dict[str, Any] = {}
    for key, value in tree.items():
        name = prefix + key
        if isinstance(value, dict) and name not in _LEAF_MAPPINGS:
            flat.update(flat_settings(value, name + "."))
        else:
            flat[name] = value
    return flat


def _changes(saved: Dict[str, Any], requested: Dict[str, Any]) -> List[str]:
    before, after = flat_settings(saved), flat_settings(requested)
    return [key for key in sorted(set(before) | set(after), key=_order)
            if before.get(key) != after.get(key)]


def _order(key: str) -> int:
    keys = list(RESUME_RULES)
    return keys.index(key) if key in keys else len(keys)


def resume_refusal(saved: Dict[str, Any], requested: Dict[str, Any], trains: bool
                   ) -> Optional[str]:
    """Why a resume from the settings ``saved`` (config.yaml's ``to_dict()``) to ``requested``
    is refused, in words to follow "cannot resume RUN_DIR: "; None when it may go on.
    ``trains``: whether steps are left to train."""
    changed = _changes(saved, requested)
    if not changed:
        return None
    before, after = flat_settings(saved), flat_settings(requested)

    def change(key: str) -> str:
        return f"{key} {before.get(key)!r} -> {after.get(key)!r}"

    kept = [key for key in changed if RESUME_RULES.get(key, (KEPT, ""))[0] == KEPT]
    if kept:
        key = kept[0]
        why = RESUME_RULES.get(key, (KEPT, "a setting this version does not know"))[1]
        more = f" (and {len(kept) - 1} more kept key(s))" if len(kept) > 1 else ""
        return (f"a resume keeps {key} ({why}), but it was asked to change: {change(key)}"
                f"{more}; nothing was changed: train a new run in another --run-dir")
    # (compare.* is read by compare, which resumes its regimes with its own values of it)
    changed = [key for key in changed if not key.startswith("compare.")]
    if not trains and changed:
        shown = ", ".join(change(key) for key in changed[:3])
        return (f"it has trained all its {before.get('training.steps')} steps, so a resume "
                f"trains nothing and keeps its record ({shown}); nothing was changed: raise "
                "training.steps to train on")
    return None


def policy_table() -> str:
    """The Markdown table of :data:`RESUME_RULES`, as the run-directories guide shows it."""
    lines = ["| key | on resume | why |", "|---|---|---|"]
    for key, (rule, why) in RESUME_RULES.items():
        lines.append(f"| `{key}` | {rule} | {why} |")
    return "\n".join(lines)
