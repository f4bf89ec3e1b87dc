"""The paper's settings resolve to the appendix's numbers (table-driven).

The tables below are typed in the appendix's layout (rows: model; columns: TENGraD,
K-FAC, EK-FAC, KBFGS, SGD; cells: lr, weight decay, damping) independently of
``tengrad_fx.optim.registry``; every cell is checked on the optimizer that
``make_optimizer(name, model, dataset, model_name)`` actually builds.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tengrad_fx
from tengrad_fx.optim.registry import PAPER_DEFAULTS, make_optimizer, paper_settings

METHODS = ("tengrad", "kfac", "ekfac", "kbfgs", "sgd")
APPENDIX = {
    ("fashion-mnist", "3c1f"): [(0.003, 0.001, 0.1), (0.003, 0.001, 0.1), (0.001, 0.003, 0.03),
                                (0.03, 0.01, 0.01), (0.03, 0.001)],
    ("cifar10", "wrn-28-4"): [(0.03, 0.003, 0.1), (0.03, 0.003, 0.03), (0.01, 0.003, 0.03),
                              (0.03, 0.003, 0.03), (0.01, 0.003)],
    ("cifar10", "densenet-19"): [(0.1, 0.003, 0.2), (0.01, 0.003, 0.03), (0.01, 0.003, 0.01),
                                 (0.01, 0.003, 0.01), (0.03, 0.003)],
    ("cifar10", "mobilenetv2"): [(0.01, 0.01, 0.2), (0.01, 0.003, 0.1), (0.01, 0.003, 0.1),
                                 (0.01, 0.03, 0.03), (0.01, 0.003)],
    ("cifar100", "wrn-28-4"): [(0.01, 0.03, 0.3), (0.003, 0.01, 0.03), (0.003, 0.01, 0.03),
                               (0.003, 0.01, 0.01), (0.01, 0.003)],
    ("cifar100", "densenet-19"): [(0.1, 0.003, 0.1), (0.01, 0.003, 0.03), (0.01, 0.003, 0.03),
                                  (0.01, 0.003, 0.03), (0.01, 0.003)],
    ("cifar100", "mobilenetv2"): [(0.01, 0.01, 0.3), (0.01, 0.003, 0.03), (0.01, 0.003, 0.03),
                                  (0.03, 0.01, 0.03), (0.01, 0.003)],
}
CASES = [(ds, mdl, method, cell) for (ds, mdl), row in APPENDIX.items() for method, cell in zip(METHODS, row)]


def _net() -> nn.Module:
    return tengrad_fx.prepare(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)),
                              example_inputs=(torch.randn(2, 4),))


@pytest.fixture(scope="module")
def net() -> nn.Module:
    return _net()


@pytest.mark.parametrize("dataset,model_name,method,cell", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_appendix_cell(dataset: str, model_name: str, method: str, cell: tuple, net: nn.Module) -> None:
    opt = make_optimizer(method, net, dataset, model_name=model_name)
    g = opt.param_groups[0]
    assert (g["lr"], g["weight_decay"], g["momentum"]) == (cell[0], cell[1], 0.9)
    if method == "sgd":
        assert len(cell) == 2 and "damping" not in PAPER_DEFAULTS["sgd"][dataset][model_name]
        return
    assert g["damping"] == cell[2]
    assert opt.kl_clip == 0.01  # the authors' code
    if method == "tengrad":
        assert (opt.fisher, opt.curvature_every) == ("mc", 100)
    elif method in ("kfac", "ekfac"):
        assert (opt.fisher, opt.curvature_every, opt.inverse_every) == ("mc", 20, 100)
        assert method == "kfac" or opt.rescale_every == 20
    else:  # kbfgs: no Fisher
        assert (opt.curvature_every, opt.inverse_every) == (20, 100)


def test_every_table_cell_is_checked() -> None:
    covered = {(ds, mdl, method) for ds, mdl, method, _ in CASES}
    in_registry = {(ds, mdl, method) for method, by_ds in PAPER_DEFAULTS.items()
                   for ds, by_model in by_ds.items() for mdl in by_model}
    assert covered == in_registry


def test_default_model_and_bad_names(net: nn.Module) -> None:
    assert paper_settings("tengrad", "cifar100")["damping"] == 0.3  # wrn-28-4 by default
    assert paper_settings("tengrad", "fashion-mnist") == paper_settings("tengrad", "fashion-mnist", "3c1f")
    opt = make_optimizer("tengrad", net, "cifar10", model_name="densenet-19", lr=0.5, fisher="empirical")
    assert opt.param_groups[0]["lr"] == 0.5 and opt.fisher == "empirical" and opt.param_groups[0]["damping"] == 0.2
    with pytest.raises(ValueError, match="model_name.*resnet18"):
        paper_settings("kfac", "cifar10", "resnet18")
    with pytest.raises(ValueError, match="dataset"):
        paper_settings("kfac", "imagenet")


def test_plain_constructor_keeps_library_defaults(net: nn.Module) -> None:
    """Without a dataset: the library defaults (T = 100, KL clip 0.01, empirical Fisher, so
    a plain SGD loop works; see TENGraD's docstring)."""
    opt = make_optimizer("tengrad", net, lr=0.1, damping=0.1)
    assert (opt.fisher, opt.curvature_every, opt.kl_clip) == ("empirical", 100, 0.01)
    assert opt.param_groups[0]["momentum"] == 0.9


def test_paper_flag_and_presets(net: nn.Module) -> None:
    """``paper=True`` builds exactly the Fashion-MNIST paper optimizer; a preset puts its
    options on the paper's settings and ``overrides`` win; an unknown preset is refused."""
    from tengrad_fx.optim.registry import PRESETS

    def settings(opt: torch.optim.Optimizer) -> tuple:
        g = opt.param_groups[0]
        return (g["lr"], g["weight_decay"], g["damping"], g["momentum"], opt.kl_clip, opt.fisher, opt.schedule,
                opt.graft)

    paper = make_optimizer("tengrad", net, "fashion-mnist")
    assert settings(make_optimizer("tengrad", net, paper=True)) == settings(paper)
    assert (paper.schedule.every, paper.schedule.warmup, paper.schedule.growth, paper.graft) == (100, 0, None, None)
    assert paper.orthogonalize is False
    for name, options in PRESETS["tengrad"].items():
        opt = make_optimizer("tengrad", net, preset=name)
        for key, value in options.items():
            got = opt.param_groups[0].get(key, getattr(opt, key, None))
            if key.startswith("curvature_"):
                got = getattr(opt.schedule, key.removeprefix("curvature_"))
            if key == "metric":
                got = type(opt.metric).__name__.removesuffix("Metric").lower()
            if key == "orthogonalize":  # the group's flag (in defaults) and the optimizer's method
                got = opt.orthogonalize if opt.param_groups[0]["orthogonalize"] is True else None
            assert got == value, (name, key)
        assert opt.kl_clip == options.get("kl_clip", paper.kl_clip) and opt.fisher == paper.fisher
    assert make_optimizer("tengrad", net, preset="fast", lr=0.5).param_groups[0]["lr"] == 0.5
    with pytest.raises(ValueError, match="preset"):
        make_optimizer("tengrad", net, preset="slow")
