"""Hostile configs, argument sets, data files and run directories, one row each.

Whatever the input, the command exits 0, exits 1 with the divergence message, or exits 2 with
one line on stderr and never a traceback. Each row also says which of these it expects and a
few words the message must hold, so that a row cannot pass by failing in some other way.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional

import pytest
from helpers import ONE_IPU, ROOT, TEXT

import ipu_unit_scaling.training.plots
from ipu_unit_scaling.apps import commands
from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.training.data import load_corpus, read_text_file
from ipu_unit_scaling.training.run_directory import make_unique_run_dir
from ipu_unit_scaling.training.run_records import MetricsLog

# A run of a second or less: one stage, two steps, one validation batch.
SMALL = [*ONE_IPU,
         "training.steps=2", "training.eval_batches=1", "training.warmup_steps=0"]
DIVERGED = re.compile(r"^ipu-unit-scaling: (validation )?(loss|weights) became (nan|inf|-inf|"
                      r"non-finite)[^\n]*; last good checkpoint: \S+\n$")


class Case(NamedTuple):
    name: str
    argv: Callable[[Path], List[str]]  # builds its files under the folder it is given
    status: int
    words: str = ""  # in the error message (status 1 or 2)


def write(tmp: Path, name: str, content: object) -> str:
    path = tmp / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(str(content), encoding="utf-8")
    return str(path)


def data(tmp: Path) -> str:
    return write(tmp, "text.txt", TEXT)


def train(tmp: Path, *extra: str, run_dir: Optional[str] = None) -> List[str]:
    return ["train", "--config", "tiny", "--data", data(tmp), "--run-dir",
            run_dir or str(tmp / "run"), "--quiet", "--set", *SMALL, *extra]


def with_config(text: object, *extra: str) -> Callable[[Path], List[str]]:
    def argv(tmp: Path) -> List[str]:
        return ["train", "--config", write(tmp, "config.yaml", text), "--data", data(tmp),
                "--run-dir", str(tmp / "run"), "--quiet", *extra]
    return argv


def setting(*overrides: str) -> Callable[[Path], List[str]]:
    return lambda tmp: train(tmp, *overrides)


def finished_run(tmp: Path) -> Path:
    assert main(train(tmp, "training.checkpoint_interval=1")) == 0
    return tmp / "run"


def resume_after(spoil: Callable[[Path], object], *extra: str) -> Callable[[Path], List[str]]:
    def argv(tmp: Path) -> List[str]:
        run_dir = finished_run(tmp)
        spoil(run_dir)
        return ["train", "--resume", str(run_dir), "--quiet", *extra]
    return argv


def with_wider_checkpoint(tmp: Path) -> Path:
    """A finished run whose checkpoint.pt is that of a wider model than its config.yaml's."""
    run_dir = finished_run(tmp)
    assert main(train(tmp, "model.hidden_size=64", run_dir=str(tmp / "wide"))) == 0
    shutil.copyfile(tmp / "wide" / "checkpoint.pt", run_dir / "checkpoint.pt")
    return run_dir


def sample(*extra: str) -> Callable[[Path], List[str]]:
    return lambda tmp: ["sample", str(finished_run(tmp)), "--tokens", "5", *extra]


def symlink_loop(tmp: Path) -> str:
    (tmp / "loop").symlink_to("loop")
    return str(tmp / "loop")


def broken_symlink(tmp: Path) -> str:
    (tmp / "dangling").symlink_to("nowhere")
    return str(tmp / "dangling")


def undecodable(tmp: Path, name: bytes) -> str:
    return str(tmp / os.fsdecode(name))  # as Python gives such a command-line argument


def nested_yaml(levels: int) -> str:
    return "model: " + "[" * levels + "]" * levels + "\n"


def nested_mapping(levels: int) -> str:
    return "model:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(levels))


def laughs() -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        refs = ", ".join([f"*a{i - 1}"] * 9)
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "\n".join(lines) + "\nipu:\n  layers_per_ipu: *a8\n"


def proc_file(tmp: Path) -> str:
    return "/proc/self/mem"  # opens, then every read fails (EIO), even for root


CASES = [
    # --- config files that cannot be read
    Case("config-not-utf8", with_config(b"model:\n  depth: \xff\xfe\n"), 2, "not UTF-8 text"),
    Case("config-is-a-checkpoint", lambda tmp: ["train", "--config", _checkpoint(tmp),
                                                "--run-dir", str(tmp / "r")], 2, "not UTF-8"),
    Case("config-nested-20000", with_config(nested_yaml(20000)), 2, "nested too deeply"),
    Case("config-mapping-nested-3000", with_config(nested_mapping(3000)), 2,
         "nested too deeply"),
    Case("config-yaml-flow-error", with_config("model: [1, 2\ntraining: 3\n"), 2,
         "line 2, column"),
    Case("config-yaml-tab", with_config("model:\n\tdepth: 2\n"), 2, "line 2, column 1"),
    Case("config-yaml-mapping-value", with_config("model: depth: 2\n"), 2, "line 1, column"),
    Case("config-yaml-unclosed-quote", with_config('backend: "cpu\n'), 2, "line"),
    Case("config-yaml-python-tag", with_config("model: !!python/object:os.system {}\n"), 2,
         "not valid YAML"),
    Case("config-yaml-unhashable-key", with_config("? [1, 2]\n: x\n"), 2, "not valid YAML"),
    Case("config-nul-byte", with_config(b"model:\x00 {}\n"), 2, "not valid YAML"),
    Case("config-a-list", with_config("[1, 2]\n"), 2, "must hold a mapping"),
    Case("config-a-number", with_config("42\n"), 2, "must hold a mapping"),
    Case("config-billion-laughs", with_config(laughs()), 2, "unknown key"),
    Case("config-missing", lambda tmp: ["train", "--config", str(tmp / "none.yaml")], 2,
         "not found"),
    Case("config-empty-name", lambda tmp: ["train", "--config", ""], 2, "not found"),
    Case("config-a-directory", lambda tmp: ["train", "--config", str(tmp)], 2,
         "not a regular file"),
    Case("config-unreadable", lambda tmp: ["train", "--config", proc_file(tmp)], 2,
         "cannot read config file"),
    Case("config-extends-cycle", lambda tmp: ["train", "--config", write(
        tmp, "loop.yaml", "extends: loop.yaml\n")], 2, "cycle"),
    Case("config-extends-missing", with_config("extends: nowhere.yaml\n"), 2, "not found"),
    Case("config-extends-number", with_config("extends: 5\n"), 2, "expected a file path"),
    Case("config-extends-binary", lambda tmp: ["train", "--config", write(
        tmp, "child.yaml", f"extends: {Path(_checkpoint(tmp)).name}\n")], 2, "not UTF-8"),
    # --- configs with bad keys or values
    Case("unknown-section", with_config("modle: {depth: 2}\n"), 2, "did you mean 'model'"),
    Case("numeric-key", with_config("model: {1: 2}\n"), 2, "model.1: unknown key"),
    Case("section-a-list", with_config("training: [1, 2]\n"), 2, "expected a mapping"),
    Case("section-null", with_config("model: null\n"), 2, "expected a mapping"),
    Case("huge-string", with_config("backend: " + "x" * 1_000_000 + "\n"), 2, "backend: got"),
    Case("hidden-size-float", setting("model.hidden_size=1e9"), 2, "expected an int"),
    Case("hidden-size-huge", setting("model.hidden_size=1000000000", "model.heads=1"), 2,
         "one training step needs about"),
    Case("hidden-size-astronomic", setting("model.hidden_size=" + "9" * 40, "model.heads=1"), 2,
         "integers in a config are -2**63 .. 2**63 - 1"),
    Case("seq-len-40000", lambda tmp: ["train", "--run-dir", str(tmp / "run"), "--set",
                                       "model.seq_len=40000"], 2, "one training step needs"),
    Case("eval-batches-huge", setting("training.eval_batches=10000000000"), 2,
         "one training step needs"),
    Case("depth-huge", setting("model.depth=100000000", "ipu.layers_per_ipu=[-1]"), 2,
         "one training step needs"),
    Case("seed-beyond-64-bits", setting("training.seed=" + str(2**64)), 2, "training.seed"),
    Case("seed-negative", setting("training.seed=-5"), 2, "training.seed"),
    Case("steps-zero", setting("training.steps=0"), 2, "training.steps"),
    Case("steps-string", setting("training.steps=many"), 2, "expected an int"),
    Case("lr-infinite", setting("training.learning_rate=.inf"), 2, "finite float"),
    Case("lr-nan", setting("training.learning_rate=.nan"), 2, "finite float"),
    Case("lr-negative", setting("training.learning_rate=-1"), 2, "must be > 0"),
    Case("fp8-margin-negative", setting("precision.fp8.gradient_margin=-3"), 2,
         "precision.fp8.gradient_margin: got -3; allowed: 0 .. 31"),
    Case("fp8-margin-bool", setting("precision.fp8.weight_margin=true"), 2, "expected an int"),
    Case("fp8-format", setting("precision.fp8.activation_format=E3M4"), 2, "valid formats"),
    Case("heads-not-dividing", setting("model.heads=3"), 2, "must divide"),
    Case("heads-zero", setting("model.heads=0"), 2, "model.heads"),
    Case("dropout-one", setting("model.dropout=1"), 2, "model.dropout"),
    Case("tau-zero", setting("model.attn_tau=0"), 2, "model.attn_tau"),
    Case("vocab-below-corpus", setting("model.vocab_size=5"), 2, "raise model.vocab_size"),
    Case("layers-nested-lists", setting("ipu.layers_per_ipu=[[[[1]]]]"), 2,
         "expected a list of ints"),
    Case("device-iterations-past-steps", setting("ipu.device_iterations=3"), 2,
         "multiple of ipu.device_iterations"),
    Case("accumulation-huge", setting("ipu.gradient_accumulation=1000000"), 2,
         "training.batch_size"),
    Case("val-fraction-almost-one", setting("data.val_fraction=0.999"), 2, "too short"),
    Case("data-path-empty-in-config", setting("data.path=''"), 2, "data.path"),
    Case("backend-ipu-without-sdk", setting("backend=ipu"), 2, "needs PopTorch"),
    Case("backend-unknown", setting("backend=gpu"), 2, "backend"),
    Case("regimes-twice", lambda tmp: ["compare", "--run-dir", str(tmp / "c"), "--regimes",
                                       "fp32", "fp32"], 2, "lists a regime twice"),
    Case("compare-no-regimes", lambda tmp: ["compare", "--run-dir", str(tmp / "c"), "--set",
                                            "compare.regimes=[]"], 2, "at least one regime"),
    Case("compare-rate-negative", setting("compare.learning_rates={fp32: -1}"), 2,
         "compare.learning_rates.fp32"),
    # --- overrides and arguments
    Case("override-without-equals", setting("training.steps"), 2, "section.key=value"),
    Case("override-empty-key", setting("=5"), 2, "section.key=value"),
    Case("override-bad-yaml", setting("training.steps=[1,"), 2, "not valid YAML"),
    Case("override-nested-deep", setting("model.depth=" + "[" * 3000), 2, "nested too deeply"),
    Case("override-into-a-value", setting("training.steps.x=1"), 2, "is not a section"),
    Case("override-unknown-deep", setting("a.b.c.d=1"), 2, "unknown key"),
    Case("threads-word", lambda tmp: ["train", "--threads", "many"], 2, "positive integer"),
    Case("threads-huge", lambda tmp: ["train", "--threads", "1" + "0" * 30], 2, "at most"),
    Case("scale-report-zero", lambda tmp: ["train", "--scale-report", "0"], 2,
         "positive integer"),
    Case("unknown-option", lambda tmp: ["train", "--frobnicate"], 2, "unrecognized"),
    Case("unknown-command", lambda tmp: ["fly"], 2, "invalid choice"),
    Case("no-command", lambda tmp: [], 2, "no command"),
    Case("resume-with-config", lambda tmp: ["train", "--resume", str(tmp), "--config", "tiny"],
         2, "--resume continues a run"),
    # --- data files
    Case("data-empty-name", lambda tmp: ["train", "--data", "", "--run-dir", str(tmp / "r")], 2,
         "--data needs a file name"),
    Case("data-missing", lambda tmp: ["train", "--data", str(tmp / "none.txt"), "--run-dir",
                                      str(tmp / "r")], 2, "does not exist"),
    Case("data-a-directory", lambda tmp: ["train", "--data", str(tmp), "--run-dir",
                                          str(tmp / "r")], 2, "not a regular file"),
    Case("data-unreadable", lambda tmp: ["train", "--data", proc_file(tmp), "--run-dir",
                                         str(tmp / "r")], 2, "cannot read data file"),
    Case("data-nul-in-name", lambda tmp: ["train", "--data", "a\0b", "--run-dir",
                                          str(tmp / "r")], 2, "a\\x00b' does not exist"),
    Case("data-binary", lambda tmp: ["train", "--data", write(tmp, "b.bin", b"\x80\x81" * 400),
                                     "--run-dir", str(tmp / "r")], 2, "not UTF-8"),
    Case("data-whitespace", lambda tmp: ["train", "--data", write(tmp, "w.txt", " \n" * 500),
                                         "--run-dir", str(tmp / "r")], 2, "only whitespace"),
    Case("data-too-short", lambda tmp: ["train", "--data", write(tmp, "s.txt", "hello"),
                                        "--run-dir", str(tmp / "r")], 2, "too short"),
    # --- run directories
    Case("run-dir-under-proc", lambda tmp: train(tmp, run_dir="/proc/self/new-run"), 2,
         "cannot create run directory"),
    Case("checkpoint-dir-under-proc", lambda tmp: ["train", "--data", data(tmp), "--set",
                                                   *SMALL, "training.checkpoint_dir=/proc/1/x"],
         2, "cannot create run directory"),
    Case("run-dir-a-file", lambda tmp: train(tmp, run_dir=data(tmp)), 2, "is not a directory"),
    Case("checkpoint-dir-a-file", lambda tmp: ["train", "--data", data(tmp), "--set", *SMALL,
                                               f"training.checkpoint_dir={data(tmp)}"], 2,
         "cannot create run directory"),
    Case("run-dir-nul", lambda tmp: ["train", "--run-dir", "r\0n"], 2, "not a usable path"),
    Case("compare-run-dir-a-file", lambda tmp: ["compare", "--run-dir", data(tmp)], 2,
         "is not a directory"),
    Case("analyse-run-dir-a-file", lambda tmp: ["analyse", "--config", "tiny", "--run-dir",
                                                data(tmp)], 2, "is not a directory"),
    Case("analyse-huge-model", lambda tmp: ["analyse", "--run-dir", str(tmp / "a"), "--set",
                                            "model.hidden_size=200000", "model.heads=1"], 2,
         "one training step needs"),
    Case("resume-missing-dir", lambda tmp: ["train", "--resume", str(tmp / "none")], 2,
         "no such directory"),
    Case("resume-a-file", lambda tmp: ["train", "--resume", data(tmp)], 2, "not a directory"),
    Case("resume-symlink-loop", lambda tmp: ["train", "--resume", symlink_loop(tmp)], 2,
         "symbolic link loop"),
    Case("resume-broken-symlink", lambda tmp: ["train", "--resume", broken_symlink(tmp)], 2,
         "broken symbolic link (to nowhere)"),
    Case("init-from-symlink-loop", lambda tmp: ["train", "--init-from", symlink_loop(tmp)], 2,
         "symbolic link loop"),
    Case("evaluate-symlink-loop", lambda tmp: ["evaluate", symlink_loop(tmp)], 2,
         "symbolic link loop"),
    Case("sample-symlink-loop", lambda tmp: ["sample", symlink_loop(tmp)], 2,
         "symbolic link loop"),
    Case("run-dir-symlink-loop", lambda tmp: train(tmp, run_dir=symlink_loop(tmp)), 2,
         "symbolic link loop"),
    Case("run-dir-broken-symlink", lambda tmp: train(tmp, run_dir=broken_symlink(tmp)), 2,
         "broken symbolic link"),
    Case("run-dir-undecodable", lambda tmp: train(tmp, run_dir=undecodable(tmp, b"r\xff")), 2,
         "not UTF-8"),
    Case("checkpoint-dir-undecodable", lambda tmp: ["train", "--data", data(tmp), "--set",
                                                    *SMALL, "training.checkpoint_dir="
                                                    + undecodable(tmp, b"c\xff")], 2,
         "training.checkpoint_dir"),
    Case("data-name-undecodable", lambda tmp: ["train", "--data", undecodable(tmp, b"d\xff"),
                                               "--run-dir", str(tmp / "r")], 2, "does not exist"),
    Case("resume-empty-dir", lambda tmp: ["train", "--resume", str(tmp)], 2,
         "config.yaml is missing"),
    Case("resume-metrics-missing", resume_after(lambda d: (d / "metrics.csv").unlink(),
                                                "--set", "training.steps=4"), 2,
         "metrics.csv is missing"),
    Case("resume-metrics-partial-row", resume_after(lambda d: (d / "metrics.csv").write_text(
        (d / "metrics.csv").read_text()[:-20]), "--set", "training.steps=4"), 2,
        "metrics.csv is damaged"),
    Case("resume-config-empty", resume_after(lambda d: (d / "config.yaml").write_text("")), 2,
         "config.yaml is empty"),
    Case("resume-tokenizer-garbage", resume_after(
        lambda d: (d / "tokenizer.json").write_bytes(b"\x00" * 10)), 2, "tokenizer.json"),
    Case("resume-other-shape", resume_after(lambda d: None, "--set", "model.depth=3",
                                            "training.steps=4"), 2, "does not fit"),
    Case("resume-wider-checkpoint", lambda tmp: ["train", "--resume", str(
        with_wider_checkpoint(tmp)), "--quiet", "--set", "training.steps=4"], 2,
        "checkpoint does not fit this config: size mismatch for embedding.weight: copying a "
        "param with shape [40, 64] from checkpoint, the shape in current model is [40, 32]"),
    Case("init-from-wider-checkpoint", lambda tmp: ["train", "--init-from", str(
        with_wider_checkpoint(tmp)), "--run-dir", str(tmp / "tuned"), "--quiet"], 2,
        "its checkpoint.pt does not fit its config.yaml: size mismatch for embedding.weight"),
    Case("sample-wider-checkpoint", lambda tmp: ["sample", str(with_wider_checkpoint(tmp))], 2,
         "does not fit config.yaml (size mismatch for embedding.weight"),
    Case("resume-fewer-steps", resume_after(lambda d: None, "--set", "training.steps=1"), 2,
         "beyond training.steps"),
    Case("resume-summary-garbage", resume_after(
        lambda d: (d / "summary.json").write_text(json.dumps([1] * 3)), "--set",
        "training.steps=3"), 0),
    Case("compare-damaged-regime", lambda tmp: _damaged_regime(tmp), 2,
         "config.yaml is incomplete"),
    # --- sampling arguments
    Case("sample-seed-huge", sample("--seed", "9" * 23), 2, "--seed: expected an integer"),
    Case("sample-seed-negative", sample("--seed", "-1"), 2, "--seed: expected an integer"),
    Case("sample-seed-word", sample("--seed", "x"), 2, "--seed: expected an integer"),
    Case("sample-temperature-tiny", sample("--temperature", "1e-300"), 0),
    Case("sample-temperature-subnormal", sample("--temperature", "5e-324", "--top-k", "3"), 0),
    # --- inputs that train, or diverge
    Case("warmup-longer-than-run", setting("training.warmup_steps=50"), 0),
    Case("seq-len-one", setting("model.seq_len=1"), 0),
    Case("empty-config-file", with_config("", "--set", *SMALL, "model.depth=1"), 0),
    Case("bom-and-anchors", with_config("\ufeffbase: &b {depth: 1}\n", "--set", *SMALL), 2,
         "unknown key"),
    Case("one-character-corpus", lambda tmp: ["train", "--config", "tiny", "--data", write(
        tmp, "a.txt", "a" * 500), "--run-dir", str(tmp / "r"), "--quiet", "--set", *SMALL], 0),
    Case("learning-rate-1e30", setting("training.learning_rate=1e30", "training.steps=6",
                                       "training.optimizer=sgd"), 1, "became"),
    Case("weight-decay-1e30", setting("training.weight_decay=1e30", "training.steps=4",
                                      "training.optimizer=sgd"), 2, "0 <= x <= 2**20"),
    Case("tau-1e300", setting("model.attn_tau=1e300"), 2, "model.attn_tau"),
    Case("tau-large", setting("model.mlp_tau=1000"), 0),
]


def _checkpoint(tmp: Path) -> str:
    from ipu_unit_scaling.training.run_records import save_checkpoint

    path = tmp / "checkpoint.pt"
    save_checkpoint(path, {"step": 1, "model": {}})
    return str(path)


def _damaged_regime(tmp: Path) -> List[str]:
    argv = ["compare", "--config", "tiny", "--data", data(tmp), "--run-dir", str(tmp / "c"),
            "--quiet", "--regimes", "fp32", "--set", *SMALL]
    assert main(argv) == 0
    config = tmp / "c" / "fp32" / "config.yaml"
    config.write_text(config.read_text()[:200])
    return argv


def test_the_table_is_big_enough():
    assert len(CASES) >= 60 and len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_hostile_input_exits_cleanly(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default run directories land here
    monkeypatch.setattr(ipu_unit_scaling.training.plots, "plot_run", lambda *args, **kwargs: None)
    argv = case.argv(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ipu-unit-scaling", *argv])  # as the lock records it
    capsys.readouterr()
    status = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert status in (0, 1, 2), err
    if status == 2:
        assert err.startswith("ipu-unit-scaling: error: ") and err.count("\n") == 1, err
        assert "internal error" not in err, err  # the last-resort handler means a bug
    if status == 1:
        assert DIVERGED.match(err), err
    assert status == case.status, err
    assert case.words in err, err
    assert len(err) < 2000  # one readable line, even for megabyte values


def test_the_real_command_line_prints_one_line(tmp_path):
    """In a fresh interpreter too (its own recursion limit and entry point)."""
    config = write(tmp_path, "config.yaml", nested_yaml(20000))
    result = subprocess.run(
        [sys.executable, "-m", "ipu_unit_scaling.apps.cli", "train", "--config", config],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
        text=True, timeout=120,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert "nested too deeply" in result.stderr


def _everything_under(folder: Path) -> List[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def _refused_fine_tune(tmp: Path) -> List[str]:
    return ["train", "--init-from", str(finished_run(tmp)), "--quiet", "--set",
            "model.depth=3"]


REFUSED_STARTS = {
    "data-missing": lambda tmp: ["train", "--data", str(tmp / "none.txt")],
    "data-not-utf8": lambda tmp: ["train", "--data", write(tmp, "b.bin", b"\x80" * 800)],
    "out-of-memory": lambda tmp: ["train", "--config", "tiny", "--data", data(tmp), "--set",
                                  "model.hidden_size=1000000000", "model.heads=1"],
    "fine-tune-other-model": _refused_fine_tune,
    "fine-tune-wider-checkpoint": lambda tmp: ["train", "--init-from", str(
        with_wider_checkpoint(tmp)), "--quiet"],
    "compare-data-missing": lambda tmp: ["compare", "--data", str(tmp / "none.txt")],
}


@pytest.mark.parametrize("explicit", [False, True], ids=["default-dir", "run-dir"])
@pytest.mark.parametrize("name", sorted(REFUSED_STARTS))
def test_a_refused_start_leaves_nothing_behind(name, explicit, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ipu_unit_scaling.training.plots, "plot_run", lambda *args, **kwargs: None)
    argv = REFUSED_STARTS[name](tmp_path)
    if explicit:
        argv += ["--run-dir", str(tmp_path / "new" / "run")]
    before = _everything_under(tmp_path)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" not in err, err
    assert _everything_under(tmp_path) == before


def test_a_failure_after_training_started_keeps_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ipu_unit_scaling.training.plots, "plot_run", lambda *args, **kwargs: None)
    argv = train(tmp_path, "training.learning_rate=1e30", "training.steps=6",
                 "training.optimizer=sgd", run_dir=str(tmp_path / "new" / "run"))
    assert main(argv) == 1  # diverged: its metrics and summary say how
    assert (tmp_path / "new" / "run" / "summary.json").is_file()


def test_a_refused_start_keeps_a_directory_it_did_not_create(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    assert main(["train", "--data", str(tmp_path / "none.txt"), "--run-dir",
                 str(tmp_path / "mine")]) == 2
    assert (tmp_path / "mine").is_dir()


def test_default_run_directories_of_the_same_second_differ(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ipu_unit_scaling.training.plots, "plot_run", lambda *args, **kwargs: None)
    monkeypatch.setattr(commands.time, "strftime", lambda *args: "20250101-000000")
    argv = ["train", "--config", "tiny", "--data", data(tmp_path), "--quiet", "--set", *SMALL]
    assert main(argv) == 0
    assert main(argv) == 0, capsys.readouterr().err
    runs = sorted(path.name for path in (tmp_path / "runs").iterdir())
    assert runs == ["train-20250101-000000", "train-20250101-000000-2"]
    assert all((tmp_path / "runs" / run / "checkpoint.pt").is_file() for run in runs)


def test_run_directories_made_at_once_are_all_different(tmp_path):
    barrier = threading.Barrier(8)
    made: List[Path] = []

    def make() -> None:
        barrier.wait()
        made.append(make_unique_run_dir(tmp_path / "runs", "train-20250101-000000")[0])

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(made)) == 8 and all(path.is_dir() for path in made)


def _full_disk(monkeypatch) -> None:
    """Every write to a file fails as on a full disk (the terminal's descriptors still work)."""
    real_write = os.write

    def write(fd: int, data: bytes) -> int:
        if fd > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_names_the_file(tmp_path, capsys, monkeypatch):
    _full_disk(monkeypatch)
    assert main(train(tmp_path)) == 2
    err = capsys.readouterr().err
    match = re.fullmatch(r"ipu-unit-scaling: error: No space left on device \((\S+)\)\n", err)
    assert match and Path(match.group(1)).parent == tmp_path / "run", err


def test_a_full_disk_during_training_names_the_file(tmp_path, monkeypatch):
    log = MetricsLog(tmp_path / "metrics.csv", fresh=True)
    _full_disk(monkeypatch)
    with pytest.raises(OSError, match="No space left on device") as raised:
        log.write({"step": 1})
    log.close()
    assert raised.value.filename == str(tmp_path / "metrics.csv")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_under_the_scale_report_names_the_file(tmp_path):
    import torch

    from ipu_unit_scaling.analysis import ScaleReporter
    from ipu_unit_scaling.models import GPTConfig, build_gpt

    reporter = ScaleReporter(tmp_path, 1)
    reporter.path = Path("/dev/full")  # every write: ENOSPC
    gpt = GPTConfig(vocab_size=8, seq_len=4, hidden_size=8, heads=2, depth=1)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(OSError, match="No space left on device") as raised:
        reporter.maybe_record(1, build_gpt(gpt), ids, ids)
    assert raised.value.filename == "/dev/full"


def test_a_byte_order_mark_is_not_a_character(tmp_path):
    path = write(tmp_path, "bom.txt", "\ufeff" + TEXT)
    assert read_text_file(path) == TEXT
    corpus = load_corpus(path, 0.1, 16)
    assert "\ufeff" not in corpus.tokenizer.chars
    assert corpus.tokenizer.chars == sorted(set(TEXT))
