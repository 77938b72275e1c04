"""Two processes running a two-stage torch.distributed.pipelining split (gloo, CPU) follow the
single-process fallback's loss trajectory."""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ipu_unit_scaling.config import (
    Config,
    ConfigError,
    config_from_dict,
    load_config,
    scheduled_learning_rate,
    validate,
)

HERE = Path(__file__).resolve().parent
STEPS = 5


def _standin_module():
    spec = importlib.util.spec_from_file_location("_standin", HERE / "test_training_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(*overrides: str) -> Config:
    common = ["model.depth=4", "training.learning_rate=3e-2", "training.warmup_steps=2",
              "training.grad_clip=0.5"]
    return load_config("tiny", common + list(overrides))


def _batches(config: Config):
    # One batch over and over, so the loss must fall if the steps are right.
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 17, (config.training.batch_size, 9), generator=generator)
    for _ in range(STEPS):
        yield ids[:, :-1], ids[:, 1:]


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "standin":
        return _standin_module().StandInGPT(depth=4)
    from dataclasses import asdict

    from ipu_unit_scaling.models import GPTConfig, build_gpt

    config = _config("ipu.layers_per_ipu=[2, 2]")
    fields = asdict(config.model)
    fields.update(vocab_size=17, seq_len=8)
    return build_gpt(GPTConfig(**fields))


def _single_process_losses(config: Config, kind: str):
    from ipu_unit_scaling.backends import build_training_model, make_optimizer
    from ipu_unit_scaling.config import scheduled_learning_rate

    model = _model(kind)
    optimizer = make_optimizer(model.parameters(), config, backend="cpu")
    wrapper = build_training_model(model, optimizer, config, backend="cpu")
    losses = []
    for step, (inputs, labels) in enumerate(_batches(config)):
        for group in optimizer.param_groups:
            group["lr"] = scheduled_learning_rate(config.training, step)
        _, loss = wrapper(inputs, labels)
        losses.append(float(loss.mean()))
    return losses


def _worker() -> None:
    """One rank; run as a script by the test with RANK/WORLD_SIZE/MASTER_* in the environment."""
    import torch.distributed as dist

    from ipu_unit_scaling.backends.distributed import train_pipeline

    kind, raw, out = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    config = config_from_dict(raw)
    validate(config)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        losses = train_pipeline(_model(kind), config, _batches(config), STEPS)
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{dist.get_rank() if dist.is_initialized() else os.environ['RANK']}",
              "w") as handle:
        json.dump(losses, handle)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_ranks(config: Config, kind: str, tmp_path: Path):
    world = config.ipu.ipus_per_replica * config.ipu.replication_factor
    port = _free_port()
    out = tmp_path / "losses"
    root = str(HERE.parent)
    processes = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        command = [sys.executable, str(HERE / "test_distributed.py"), "--worker", kind,
                   json.dumps(config.to_dict()), str(out)]
        processes.append(subprocess.Popen(command, env=env, cwd=root,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = [p.communicate(timeout=120)[0].decode() for p in processes]
    failed = [log for process, log in zip(processes, logs) if process.returncode != 0]
    assert not failed, "\n".join(log[-3000:] for log in failed)
    return [json.loads((tmp_path / f"losses.{rank}").read_text()) for rank in range(world)]


pytest.importorskip("torch.distributed.pipelining")
needs_gloo = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


@needs_gloo
def test_replicas_average_gradients_like_the_fallback(tmp_path):
    config = _config("ipu.ipus_per_replica=1", "ipu.layers_per_ipu=[4]",
                     "ipu.replication_factor=2", "ipu.gradient_accumulation=2")
    expected = _single_process_losses(config, "standin")
    assert _run_ranks(config, "standin", tmp_path)[0] == pytest.approx(expected, abs=1e-5, rel=0)


@needs_gloo
def test_two_stage_pipeline_matches_single_process(tmp_path):
    pytest.importorskip("ipu_unit_scaling.models")
    config = _config("ipu.layers_per_ipu=[1, 3]")  # uneven: the boundary is off-centre
    expected = _single_process_losses(config, "gpt")
    per_rank = _run_ranks(config, "gpt", tmp_path)
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1]
    assert len(per_rank[0]) == STEPS
    assert per_rank[0][-1] < per_rank[0][0]
    assert per_rank[0] == pytest.approx(expected, abs=1e-5, rel=0)


def test_steps_option_is_the_run_length_the_schedule_follows():
    from ipu_unit_scaling.backends.distributed import config_from_arguments

    config = config_from_arguments(["--config", "tiny", "--steps", "50"])
    assert config.training.steps == 50 and load_config("tiny").training.steps == 5
    rates = [scheduled_learning_rate(config.training, step) for step in range(50)]
    assert all(rate > 0 for rate in rates)  # still learning at the last step
    assert rates == sorted(rates, reverse=True) and rates[0] == config.training.learning_rate
    # Without --steps, training.steps (as set by --set too) is the length.
    assert config_from_arguments(["--config", "tiny", "--set", "training.steps=7"]
                                 ).training.steps == 7
    with pytest.raises(SystemExit):
        config_from_arguments(["--config", "tiny", "--steps", "0"])
    with pytest.raises(ConfigError, match="training.steps"):
        config_from_arguments(["--config", "tiny", "--steps", "5", "--set",
                               "ipu.device_iterations=2"])


@needs_gloo
def test_train_pipeline_schedules_the_steps_it_runs(tmp_path):
    """``steps`` given apart from training.steps sets the schedule's length; a trainer asked
    for a step past training.steps refuses instead of training at a zero learning rate."""
    import torch.distributed as dist

    from ipu_unit_scaling.backends.distributed import PipelineTrainer, train_pipeline

    single = _config("ipu.ipus_per_replica=1", "ipu.layers_per_ipu=[4]")
    short = _config("ipu.ipus_per_replica=1", "ipu.layers_per_ipu=[4]", "training.steps=2")
    expected = _single_process_losses(single, "standin")  # a 5-step schedule
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        losses = train_pipeline(_model("standin"), short, _batches(short), STEPS)
        assert losses == pytest.approx(expected, abs=1e-5, rel=0)
        trainer = PipelineTrainer(_model("standin"), short)
        batches = _batches(short)
        for _ in range(2):
            trainer.step(*next(batches))
        with pytest.raises(ValueError, match="past training.steps = 2"):
            trainer.step(*next(batches))
    finally:
        dist.destroy_process_group()


@needs_gloo
def test_torchrun_steps_option_trains_with_a_schedule_of_that_length(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    steps = 8  # configs/tiny.yaml's schedule is 5 steps long
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "ipu_unit_scaling.backends.distributed",
               "--config", "tiny", "--steps", str(steps), "--set", "training.log_interval=1",
               f"data.path={data}"]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(command, cwd=HERE.parent, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    logged = [line.split() for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [words[1] for words in logged] == [f"{s}/{steps}" for s in range(1, steps + 1)]
    training = load_config("tiny", [f"training.steps={steps}"]).training
    assert [words[5] for words in logged] == \
        [f"{scheduled_learning_rate(training, s):.6g}" for s in range(steps)]
    assert all(float(words[5]) > 0 for words in logged)


def test_stage_bounds():
    pytest.importorskip("torch.distributed.pipelining")
    from ipu_unit_scaling.backends.distributed import stage_bounds

    assert stage_bounds([1, 3], 0) == (0, 1)
    assert stage_bounds([1, 3], 1) == (1, 4)
    assert stage_bounds([0, 2, 2], 1) == (0, 2)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker()
