"""Mixture-of-experts weights ``[E, d_out, d_in]`` (:mod:`tengrad_fx.capture.experts`):
Mixtral's experts and router covered as ``"param"`` layers whose per-sample gradients, Gram, ``Jv``
and ``Jᵀc`` equal ``torch.func``'s in float64, and one TENGraD step equal to dense block
NGD. The reference runs the same weights through transformers' ``batched_mm`` experts
(the eager loop's data-dependent routing does not ``vmap``)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tengrad_fx import TENGraD, get_info, prepare, unprepare
from tengrad_fx.capture.experts import ExpertLinear
from testing.oracle import check_covered_layers, dense_layer_updates
from testing.tengrad_step import assert_matches, step_delta

from ._hf import Call, token_loss

transformers = pytest.importorskip("transformers")


def _mixtral(implementation: str = "eager") -> torch.nn.Module:
    cfg = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16)
    cfg._experts_implementation = implementation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return transformers.MixtralForCausalLM(cfg).double().eval()


def _reference(wrapper: Call) -> Call:
    ref = copy.deepcopy(wrapper)
    ref.model.config._experts_implementation = "batched_mm"
    for mod in ref.modules():
        if hasattr(mod, "config") and hasattr(mod, "num_experts"):
            mod.config = ref.model.config
    return ref


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, 64, (4, 5), generator=gen), torch.randint(0, 64, (4, 5), generator=gen)


def _prepared() -> tuple[torch.nn.Module, Call, torch.Tensor, torch.Tensor]:
    """(Mixtral prepared on the batch's first two samples, its ``batched_mm`` reference, x, y)."""
    wrapper = Call(_mixtral())
    ref = _reference(wrapper)
    x, y = _batch()
    return prepare(wrapper, example_inputs=(x[:2],)), ref, x, y


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_mixtral_experts_covered_and_exact() -> None:
    model, ref, x, y = _prepared()
    info = get_info(model)
    experts = sorted(n for n in info.covered if ".experts." in n)
    assert [n.rsplit(".", 2)[1:] for n in experts] == [["experts", "down_proj"], ["experts", "gate_up_proj"]], \
        info.fallback
    assert not info.fallback, info.fallback  # the router's weight too (:mod:`tengrad_fx.capture.routers`)
    assert any(n.endswith("mlp.gate.weight") for n in info.covered)
    check_covered_layers(ref, model, x, y, loss_fn=token_loss, tol=1e-10)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_mixtral_tengrad_step_is_dense_block_ngd() -> None:
    model, ref, x, y = _prepared()
    damping = 0.05
    opt = TENGraD(model, lr=1.0, damping=damping, momentum=0.0, curvature_every=1, kl_clip=None)
    token_loss(model(x), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    delta = step_delta(model, opt)
    covered = get_info(model).covered
    want_ref = dense_layer_updates(ref, x, y, token_loss, grads, damping, covered)
    moe = [n for n in covered if ".experts." in n or n.endswith("mlp.gate.weight")]
    assert len(moe) == 3
    assert_matches({n: delta[n] for n in moe}, {n: want_ref[n] for n in moe}, tol=1e-8)


@pytest.mark.parametrize("transposed", [False, True])
def test_expert_linear_per_sample_gradients(transposed: bool) -> None:
    """``P[i, e] = Σ_{s ∈ i, e_s = e} g_s x_sᵀ`` against a loop over pairs (float64)."""
    from tengrad_fx.capture.store import CaptureStore

    gen = torch.Generator().manual_seed(0)
    E, d_in, d_out, m, S = 3, 4, 5, 2, 8
    W = torch.randn(E, d_in, d_out, generator=gen, dtype=torch.float64) if transposed else \
        torch.randn(E, d_out, d_in, generator=gen, dtype=torch.float64)
    W.requires_grad_(True)
    x = torch.randn(S, d_in, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([0, 2, 2, 1, 0, 0, 2, 1])
    samples = torch.arange(S) // (S // m)
    store = CaptureStore(n_sites=1)
    y = ExpertLinear.apply(x, W, ids, samples, m, store.key, 0, transposed)
    g = torch.randn(S, d_out, generator=gen, dtype=torch.float64)
    y.backward(g)
    want = torch.zeros(m, *W.shape, dtype=torch.float64)
    for s in range(S):
        outer = torch.outer(g[s], x[s].detach())
        want[samples[s], ids[s]] += outer.t() if transposed else outer
    P = store.records[0][0].P
    assert P is not None
    torch.testing.assert_close(P.view_as(want), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(W.grad, want.sum(0), rtol=1e-12, atol=1e-12)
    Wd = W.detach()
    gx = torch.stack([g[s] @ (Wd[ids[s]].t() if transposed else Wd[ids[s]]) for s in range(S)])
    torch.testing.assert_close(x.grad, gx, rtol=1e-12, atol=1e-12)


def test_expert_bias_per_sample_gradients() -> None:
    """``P[i, e] = Σ_{s ∈ i, e_s = e} g_s`` against a loop over pairs (float64)."""
    from tengrad_fx.capture.experts import ExpertBias
    from tengrad_fx.capture.store import CaptureStore

    gen = torch.Generator().manual_seed(1)
    E, d_out, m, S = 3, 5, 2, 8
    b = torch.randn(E, d_out, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(S, d_out, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([1, 2, 2, 1, 0, 0, 2, 1])
    samples = torch.arange(S) // (S // m)
    store = CaptureStore(n_sites=1)
    out = ExpertBias.apply(y, b, ids, samples, m, store.key, 0)
    torch.testing.assert_close(out, y + b[ids])
    g = torch.randn(S, d_out, generator=gen, dtype=torch.float64)
    out.backward(g)
    want = torch.zeros(m, E, d_out, dtype=torch.float64)
    for s in range(S):
        want[samples[s], ids[s]] += g[s]
    P = store.records[0][0].P
    assert P is not None
    torch.testing.assert_close(P.view_as(want), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.grad, want.sum(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y.grad, g)


class _SequenceFirstMoe(torch.nn.Module):
    """A Mixtral MoE block fed the batch folded sequence-first (``[T·m, d]``): token row
    ``r`` belongs to sample ``r % m``, not ``r // T``."""

    def __init__(self) -> None:
        super().__init__()
        cfg = transformers.MixtralConfig(hidden_size=8, intermediate_size=6, num_local_experts=3,
                                         num_experts_per_tok=2)
        cfg._experts_implementation = "eager"
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        self.block = MixtralSparseMoeBlock(cfg)
        self.head = torch.nn.Linear(8, 3)
        for p in self.block.parameters():
            torch.nn.init.normal_(p, std=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x.transpose(0, 1).contiguous()).transpose(0, 1))


def test_token_rows_not_sample_major_fall_back() -> None:
    torch.manual_seed(0)
    model = _SequenceFirstMoe().double()
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    experts = [n for n in info.fallback if ".experts." in n or n.endswith("gate.weight")]
    assert len(experts) == 3, info.fallback  # gate_up_proj, down_proj and the router
    assert all("mixes samples" in info.fallback[n] for n in experts), info.fallback
    assert sorted(info.covered) == ["head.bias", "head.weight"]


def test_unprepare_restores_experts_and_routers() -> None:
    """``tengrad_fx.unprepare`` gives Mixtral back with its own classes and no capture state."""
    model = _mixtral()
    classes = {name: type(mod) for name, mod in model.named_modules()}
    ids, _ = _batch()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    prepared = prepare(model, example_inputs={"input_ids": ids[:2]})
    assert any(type(mod) is not classes[name] for name, mod in prepared.named_modules())  # experts swapped
    plain = unprepare(prepared)
    assert all(type(mod) is classes[name] for name, mod in plain.named_modules())
    assert not any(k.startswith("_tengrad") for mod in plain.modules() for k in vars(mod))
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, want)
