"""``example_inputs`` as the model is called: a tuple, a dict of keyword inputs, or
``(args, kwargs)``; the batch probe resizes every batch-leading tensor leaf of either."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.capture.inputs import as_call

from testing.oracle import per_sample_grads_reference


class KeywordNet(nn.Module):
    """``forward(input_ids, attention_mask=None, scale=1.0)``, as a Hugging Face model takes
    a batch dict; the mask zeroes padded tokens before pooling. ``[m, L] -> [m, 3]``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                scale: float = 1.0) -> torch.Tensor:
        h = F.relu(self.fc(self.emb(input_ids))) * scale
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        return self.head(h.mean(1))


def _batch(m: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(m)
    mask = torch.ones(m, 5)
    mask[:, 3:] = 0
    return {"input_ids": torch.randint(0, 11, (m, 5), generator=g), "attention_mask": mask}


def test_as_call_forms() -> None:
    x = torch.randn(2, 3)

    def form(c: list) -> tuple:  # type: ignore[type-arg]
        return tuple(id(a) for a in c[0]), {k: id(v) for k, v in c[1].items()}

    assert form(as_call(x)) == ((id(x),), {})
    assert form(as_call((x, x))) == ((id(x), id(x)), {})
    assert form(as_call({"a": x})) == ((), {"a": id(x)})
    assert form(as_call(((x,), {"a": x}))) == ((id(x),), {"a": id(x)})


@pytest.mark.parametrize("form", ["dict", "args-kwargs"])
def test_keyword_inputs_prepare_and_stay_exact(form: str) -> None:
    torch.manual_seed(0)
    orig = KeywordNet().double()
    b = _batch(2)
    example = b if form == "dict" else ((b["input_ids"],), {"attention_mask": b["attention_mask"], "scale": 2.0})
    pm = tengrad_fx.prepare(copy.deepcopy(orig), example_inputs=example)
    info = tengrad_fx.get_info(pm)
    assert info.verified and {s.name for s in info.layers} >= {"emb", "fc", "head"}
    batch, y = _batch(6), torch.tensor([0, 1, 2, 0, 1, 2])
    F.cross_entropy(pm(**batch), y).backward()
    # the oracle calls model(x_i): the same network through a one-input wrapper
    ref = per_sample_grads_reference(_Positional(orig), (batch["input_ids"], batch["attention_mask"]),
                                     F.cross_entropy, y)
    for layer in tengrad_fx.covered_layers(pm):
        dW, _ = layer.per_sample_grads()
        want = ref[f"net.{layer.name}.weight"]
        assert ((dW - want).norm() / want.norm()).item() <= 1e-10, layer.name


class _Positional(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.net(inputs[0], attention_mask=inputs[1])


def test_keyword_inputs_that_fail_name_example_inputs() -> None:
    with pytest.raises(RuntimeError, match="example_inputs"):
        tengrad_fx.prepare(KeywordNet(), example_inputs={"input_ids": torch.zeros(2, 5, dtype=torch.long),
                                                          "no_such_argument": torch.zeros(2)})
