"""Each script in ``examples/`` trains with ``--smoke`` (imported and run in-process):
finite losses that go down, parameters that moved, and TENGraD curvature steps taken
with the MC Fisher (so the sampled backward ran inside the stack's own loop)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import tengrad_fx

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _check(opt: Any, losses: list[float], steps: int, model: torch.nn.Module, fresh: torch.nn.Module) -> None:
    assert isinstance(opt, tengrad_fx.TENGraD) and opt.fisher == "mc"
    assert opt.counters["step"] == steps and opt.counters["skipped"] == 0
    assert opt.curvature_steps >= 1
    assert len(losses) == steps and all(torch.isfinite(torch.tensor(losses)))
    k = max(1, steps // 4)
    assert sum(losses[-k:]) < sum(losses[:k]), losses
    start = fresh.state_dict()
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, start[n])]
    assert moved and len(moved) == sum(p.requires_grad for p in model.parameters())


def test_lightning_mnist() -> None:
    pytest.importorskip("pytorch_lightning")
    ex = _load("lightning_mnist")
    module = ex.main(["--smoke", "--steps", "8"])
    opt = module.trainer.optimizers[0]
    assert opt.curvature_every == 100 and opt.kl_clip == 0.01  # the paper's setting
    ex.pl.seed_everything(0, verbose=False)
    ex.synthetic(256)  # the script's draws before the model is built
    _check(opt, module.losses, 8, module.net, ex.build_model(4))


def test_hf_trainer() -> None:
    pytest.importorskip("transformers")
    ex = _load("hf_trainer")
    trainer = ex.main(["--smoke", "--steps", "8"])
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    torch.manual_seed(0)
    _check(trainer.optimizer.optimizer, losses, 8, trainer.model, ex.build_model(smoke=True))


def test_peft_lora() -> None:
    pytest.importorskip("peft")
    ex = _load("peft_lora")
    out = ex.main(["--smoke", "--steps", "12"])
    torch.manual_seed(0)
    fresh = ex.build_model(smoke=True)
    _check(out["optimizer"], out["losses"], 12, out["model"], fresh)
    assert all("lora_" in n for n, p in out["model"].named_parameters() if p.requires_grad)


def test_timm_finetune() -> None:
    pytest.importorskip("timm")
    ex = _load("timm_finetune")
    out = ex.main(["--smoke", "--steps", "8"])
    torch.manual_seed(0)
    _check(out["optimizer"], out["losses"], 8, out["model"], ex.build_model(smoke=True))
