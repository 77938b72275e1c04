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

from ipu_unit_scaling.config import Config, config_from_dict, load_config, validate

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


def test_stage_bounds():
    pytest.importorskip("torch.distributed.pipelining")
    from ipu_unit_scaling.backends.distributed import stage_bounds

    assert stage_bounds([1, 3], 0) == (0, 1)
    assert stage_bounds([1, 3], 1) == (1, 4)
    assert stage_bounds([0, 2, 2], 1) == (0, 2)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker()
