"""unit-scaling's nanoGPT demo as a PopTorch program under ``ipu-unit-scaling emulate``: the
plain GPT, ``simulate_fp8(gpt)`` and ``unit_scale(simulate_fp8(gpt))`` (no example inputs) train
through ``poptorch.trainingModel`` with 2 replicas, 2 accumulated micro-batches and
``setOptimizer`` every step (the learning-rate schedule), then validate through
``poptorch.inferenceModel``; each next to the same model trained eagerly on the CPU from the
same weights on the same batches."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT, torch_before

pytestmark = pytest.mark.skipif(torch_before(2, 1), reason="simulate_fp8 captures with "
                                "TorchDynamo, which traces into nn modules from torch 2.1")

PROGRAM = textwrap.dedent('''
    import copy, json
    import poptorch
    import torch
    from ipu_unit_scaling.transforms import simulate_fp8, unit_scale
    from tests.transforms.nanogpt_shaped import Config, TinyGPT

    STEPS, ROWS = 4, 8
    config = Config()
    sequence = torch.arange(4 * config.block_size + 1) % config.vocab_size  # learnable
    def batch(step):
        starts = (torch.arange(ROWS) * 3 + step) % (3 * config.block_size)
        rows = torch.stack([sequence[s:s + config.block_size + 1] for s in starts.tolist()])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def rate(step, peak):
        return peak * (1.0 - step / STEPS)

    def eager(model, peak):
        optimizer = model.configure_optimizers(peak)
        for step in range(STEPS):
            for group in optimizer.param_groups:
                group["lr"] = rate(step, peak)
            _, loss = model(*batch(step))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            return model.eval()(*batch(STEPS))[1].item()

    def through_poptorch(model, peak):
        options = poptorch.Options()
        options.replicationFactor(2)
        options.Training.gradientAccumulation(2)
        optimizer = model.configure_optimizers(peak)
        training = poptorch.trainingModel(model, options, optimizer=optimizer)
        for step in range(STEPS):
            for group in optimizer.param_groups:
                group["lr"] = rate(step, peak)
            training.setOptimizer(optimizer)
            training(*batch(step))
        training.detachFromDevice()
        inference_options = poptorch.Options()
        inference_options.replicationFactor(2)
        inference = poptorch.inferenceModel(model.eval(), inference_options)
        return float(inference(*batch(STEPS))[1].mean())

    torch.manual_seed(0)
    gpt = TinyGPT(config)
    with torch.no_grad():
        initial = gpt(*batch(STEPS))[1].item()
    results = {"initial": initial}
    for name, peak in (("gpt", 3e-2), ("fp8_gpt", 3e-2), ("unit_scaled_fp8_gpt", 0.05)):
        model = copy.deepcopy(gpt)
        if name != "gpt":
            model = simulate_fp8(model)
        if name == "unit_scaled_fp8_gpt":
            model = unit_scale(model)
        names = [b.__qualname__ for b in getattr(model, "backends", [])]
        twin = copy.deepcopy(model)
        results[name] = {"backends": names, "cpu": eager(twin, peak),
                         "poptorch": through_poptorch(model, peak)}
    print(json.dumps(results))
''')


def test_the_three_demo_models_train_through_poptorch_as_on_the_cpu(tmp_path: Path) -> None:
    program = tmp_path / "demo.py"
    program.write_text(PROGRAM)
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), environment.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "ipu_unit_scaling", "emulate", "--ipus", "2",
                           str(program)], env=environment, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    initial = results["initial"]
    assert results["gpt"]["backends"] == []
    assert "quantisation" in results["fp8_gpt"]["backends"][0]
    assert "unit_scaling" in results["unit_scaled_fp8_gpt"]["backends"][0]
    # float32 ops are torch's under the stand-in; replicas and accumulated micro-batches only
    # sum the same gradients in another order. Those float32 roundings grow under Adam, whose
    # step has the same size for a gradient of any size, but stay a sliver of what training
    # gained
    plain = results["gpt"]
    assert initial - plain["cpu"] > 0.1, (plain, initial)
    assert abs(plain["poptorch"] - plain["cpu"]) < 0.01 * (initial - plain["cpu"]), plain
    for name in ("fp8_gpt", "unit_scaled_fp8_gpt"):
        run = results[name]
        # FP8 casts round stochastically from torch's generator, drawn in another order by
        # replicas: the runs differ by that noise, a small part of what training gained
        gained = initial - run["cpu"]
        assert gained > 0.1, (name, run, initial)
        assert abs(run["poptorch"] - run["cpu"]) < 0.2 * gained, (name, run, initial)
