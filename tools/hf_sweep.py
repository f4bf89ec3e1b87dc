"""Coverage of ``prepare`` over Hugging Face language-model families: every model type of
transformers' causal-LM and sequence-classification auto mappings, built from a tiny
random config, prepared with keyword ``example_inputs`` as a user would, reported by
parameter count, and every covered layer's per-sample gradients and Gram checked against
``torch.func`` (float64).

    python -m tools.hf_sweep [--families a,b,...] [--kind causal|seqcls|both] [--markdown]
                             [--write docs/coverage.md]

A family whose tiny model does not build, or whose forward fails on ``input_ids`` alone,
is listed as skipped with the error. The tiny config is the family's default config with
every width, depth, head count, expert count and vocabulary shrunk by name
(:func:`tiny_config`), so one rule covers all families.
"""
from __future__ import annotations

import argparse
import re
import signal
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

VOCAB = 96
MAX_PARAMS = 20_000_000  # a family whose tiny model is larger is skipped (a shrink that missed a config)
WIDTH = 32
# (pattern on the config key, value); the first match wins.
_SHRINK: list[tuple[str, int]] = [
    (r"^(vocab_size|n_vocab|text_vocab_size)$", VOCAB),
    (r"(^|_)(num_hidden_layers|n_layers?|num_layers|decoder_layers|encoder_layers|num_decoder_layers)$", 2),
    (r"^(num_key_value_heads|n_head_kv|num_kv_heads|multi_query_group_num|kv_heads)$", 2),
    (r"^(n_group|topk_group|num_expert_group)$", 1),
    (r"(^|_)(num_attention_heads|n_heads?|num_heads|attention_heads)$", 2),
    (r"^(head_dim|attention_head_dim|d_kv|kv_channels|qk_rope_head_dim|qk_nope_head_dim|v_head_dim)$", 16),
    (r"(^|_)(intermediate_size|ffn_dim|n_inner|d_ff|ffn_hidden_size|moe_intermediate_size|inner_dim)$", 64),
    (r"^(hidden_size|n_embd|n_embed|d_model|embed_dim|word_embed_proj_dim|dim|hidden_dim|embedding_size)$", WIDTH),
    (r"^(num_local_experts|num_experts|n_routed_experts|moe_num_experts)$", 4),
    (r"^(num_experts_per_tok|top_k|moe_topk|num_experts_per_token)$", 2),
    (r"^(max_position_embeddings|n_positions|n_ctx|max_seq_len|max_sequence_length)$", 64),
]


def _shrunk(d: dict[str, Any]) -> dict[str, Any]:
    """The keys of a config dict that :data:`_SHRINK` names, at their tiny values, with
    per-layer lists cut to the tiny depth and token ids kept inside the tiny vocabulary."""
    out: dict[str, Any] = {}
    depth = next((v for k, v in d.items() if isinstance(v, int) and re.search(_SHRINK[1][0], k)), None)
    for k, v in d.items():
        if isinstance(v, bool) or k.endswith("_token_id") or k.endswith("_token_ids"):
            continue
        if isinstance(v, int):
            for pat, new in _SHRINK:
                if re.search(pat, k) and v > new:
                    out[k] = new
                    break
        elif isinstance(v, list) and depth and len(v) == depth and depth > 2:
            out[k] = v[:2]
        elif isinstance(v, dict) and k.endswith("_config"):
            out[k] = {**v, **_shrunk(v)}
    for k, v in d.items():
        if k.endswith("_token_id") and isinstance(v, int) and v >= VOCAB:
            out[k] = VOCAB - 1 - len([kk for kk in out if kk.endswith("_token_id")])
    return out


def tiny_config(model_type: str) -> Any:
    """The default config of ``model_type`` with its sizes shrunk (:data:`_SHRINK`),
    dropout off and a pad token (sequence classification of a batch needs one)."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    kw = _shrunk(base.to_dict())
    cfg = AutoConfig.for_model(model_type, **kw)
    for k in list(vars(cfg)):
        if re.search(r"(dropout|_pdrop|dropout_rate|drop_rate)$", k) and isinstance(getattr(cfg, k), float):
            setattr(cfg, k, 0.0)
    if getattr(cfg, "pad_token_id", None) is None:
        cfg.pad_token_id = 0
    cfg.num_labels = 3
    cfg._attn_implementation = "eager"  # float64 on CPU: the reference implementations
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"
    return cfg


@dataclass
class Row:
    """One family's result: ``coverage`` by parameter count (``None`` when skipped)."""

    family: str
    kind: str
    coverage: float | None = None
    exact: str = ""
    reasons: list[str] = field(default_factory=list)
    skipped: str = ""


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout("timed out")


def build(model_type: str, kind: str) -> nn.Module:
    """The tiny ``model_type`` model for ``kind`` (``causal`` or ``seqcls``), float64, eval."""
    import transformers

    auto = transformers.AutoModelForCausalLM if kind == "causal" else transformers.AutoModelForSequenceClassification
    cfg = tiny_config(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):  # its size first: a nested config the shrink misses can be GBs
            n = sum(p.numel() for p in auto.from_config(cfg).parameters())
        if n > MAX_PARAMS:
            raise ValueError(f"the tiny config still has {n:,} parameters (a nested config not shrunk)")
        torch.manual_seed(0)
        model = auto.from_config(cfg)
    return model.double().eval()


class _Logits(nn.Module):
    """``model(**tokens(x)).logits`` (what the reference differentiates)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(**tokens(x)).logits


def tokens(x: Tensor) -> dict[str, Tensor]:
    """A training batch for the ids ``x [m, T]``: ``input_ids``, an all-ones
    ``attention_mask`` and ``use_cache=False``."""
    return {"input_ids": x, "attention_mask": torch.ones_like(x), "use_cache": False}


def _loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _batch(model: nn.Module, kind: str, m: int = 3, t: int = 5) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    vocab = model.get_input_embeddings().weight.shape[0] if model.get_input_embeddings() is not None else VOCAB
    x = torch.randint(2, min(vocab, VOCAB) - 4, (m, t), generator=g)
    y = torch.randint(0, 3, (m,), generator=g) if kind == "seqcls" else torch.randint(0, 8, (m, t), generator=g)
    eos = getattr(model.config, "eos_token_id", None)
    if kind == "seqcls" and isinstance(eos, int) and eos < VOCAB:  # classified at the end-of-sequence token
        x[:, -1] = eos
    return x, y


def _per_sample_loop(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``{param name: [m, *shape]}``: the gradient of ``_loss`` on each sample alone, by
    autograd (the reference where ``vmap`` cannot run the model)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows: dict[str, list[Tensor]] = {n: [] for n in params}
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(_loss(model(x[i:i + 1]), y[i:i + 1]), list(params.values()), allow_unused=True)
        for n, g in zip(params, grads):
            rows[n].append(torch.zeros_like(params[n]) if g is None else g)
    return {n: torch.stack(r) for n, r in rows.items()}


def exactness(orig: nn.Module, prepared: nn.Module, x: Tensor, y: Tensor, tol: float = 1e-6) -> str:
    """``"yes"`` when every covered layer's per-sample gradients and Gram equal those of
    ``vmap(grad)`` on ``orig`` (or of one backward per sample where ``vmap`` cannot run it;
    relative error ≤ ``tol``, against at least 1e-9 of the largest layer's norm), else the
    first layer that differs."""
    from tengrad_fx import covered_layers
    from testing.oracle import explicit_jacobian, per_sample_grads_reference

    prepared.zero_grad()
    _loss(prepared(**tokens(x)).logits, y).backward()
    try:
        ref = per_sample_grads_reference(_Logits(orig), x, _loss, y)
    except Exception:  # data-dependent control flow under vmap (masks, routing): one sample at a time
        ref = _per_sample_loop(_Logits(orig), x, y)
    names = {id(p): n for n, p in prepared.named_parameters()}
    # a layer whose per-sample gradients vanish (a hash router's constant weights) is held to
    # rounding relative to the largest one, not to its own norm
    floor = 1e-9 * max((t.norm().item() for t in ref.values()), default=0.0)
    worst = 0.0
    for layer in covered_layers(prepared):
        if layer.weight.grad is None:  # never called by this head (a decoder's cross-attention)
            continue
        wn = "model." + names[id(layer.weight)]
        bn = "model." + names[id(layer.bias)] if layer.bias is not None else None
        J = explicit_jacobian(ref, wn, bn)
        try:
            dW, db = layer.per_sample_grads()
        except RuntimeError as e:  # e.g. its weight also read outside its module call
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "nothing captured" in why:
                why = "nothing captured (its weight is used outside its module call)"
            return f"error: {layer.name}: {why[:100]}"
        got = dW.flatten(1) if db is None else torch.cat([dW.flatten(1), db.flatten(1)], 1)
        scale = max(J.norm().item(), floor, 1e-30)
        err = max((got - J).norm().item() / scale, (layer.gram("auto") - J @ J.T).norm().item() / scale ** 2)
        if err > tol:
            return f"no: {layer.name} ({err:.1e})"
        worst = max(worst, err)
    return "yes"


def float64_inside(model: nn.Module) -> nn.Module:
    """A twin of ``model`` (same class, config and weights) from its modeling module with
    every float32 cast (``torch.float32``, ``.float()``) made float64: for telling a capture
    error from the rounding of the model's own float32 arithmetic."""
    import copy
    import importlib.util
    import types

    name = type(model).__module__
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ValueError(f"no source for {name}")
    with open(spec.origin, encoding="utf-8") as f:
        src = f.read().replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    mod = types.ModuleType(name)
    mod.__file__, mod.__package__ = spec.origin, name.rpartition(".")[0]
    exec(compile(src, spec.origin, "exec"), mod.__dict__)
    twin = copy.deepcopy(model)
    for sub in twin.modules():  # every module of that file, wherever it sits (auto-built submodels too)
        if type(sub).__module__ == name and isinstance(getattr(mod, type(sub).__name__, None), type):
            sub.__class__ = getattr(mod, type(sub).__name__)
    return twin


def _exact_or_float32(orig: nn.Module, prepared: nn.Module, x: Tensor, y: Tensor) -> str:
    """:func:`exactness`; where it fails, the same check on :func:`float64_inside`'s twin:
    ``"yes (float32 inside)"`` when the twin is exact."""
    import copy

    from tengrad_fx import prepare

    got = exactness(orig, prepared, x, y)
    if not got.startswith("no"):
        return got
    try:
        twin = float64_inside(orig)
        if exactness(twin, prepare(copy.deepcopy(twin), example_inputs=tokens(x[:2])), x, y) == "yes":
            return "yes (float32 inside)"
    except Exception:  # the twin does not build: report the first result
        pass
    return got


def _first_line(e: Exception) -> str:
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:140] if lines else ''}"


def sweep_one(model_type: str, kind: str, check: bool = True, timeout: int = 120) -> Row:
    """Build, prepare and (``check``) verify one family; any failure becomes ``skipped``."""
    import copy

    from tengrad_fx import prepare, report

    row = Row(model_type, kind)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        try:
            model = build(model_type, kind)
            x, y = _batch(model, kind)
            with torch.no_grad():
                model(**tokens(x))
        except Exception as e:
            row.skipped = f"does not build/run tiny: {_first_line(e)}"
            return row
        orig = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = prepare(model, example_inputs=tokens(x[:2]))
        rep = report(prepared)
        row.coverage = rep.fraction_params
        counts: dict[str, int] = {}
        for p, status, detail in rep.rows:
            if status == "fallback":
                counts[detail] = counts.get(detail, 0) + rep.numel.get(p, 0)
        row.reasons = [r for r, _ in sorted(counts.items(), key=lambda kv: -kv[1])]
        if check:
            row.exact = _exact_or_float32(orig, prepared, x, y)
    except Exception as e:
        row.skipped = f"prepare/check failed: {_first_line(e)}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return row


def families(kind: str) -> list[str]:
    """The model types of transformers' causal-LM (``causal``) or sequence-classification
    (``seqcls``) auto mapping."""
    from transformers.models.auto import modeling_auto as ma

    names = (ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if kind == "causal"
             else ma.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
    return sorted(names)


def sweep(kinds: list[str], only: list[str] | None = None, check: bool = True) -> Iterator[Row]:
    for kind in kinds:
        for name in families(kind):
            if only is None or name in only:
                yield sweep_one(name, kind, check)


def _short(reason: str, n: int = 100) -> str:
    return reason if len(reason) <= n else reason[: n - 1] + "…"


def markdown(rows: list[Row]) -> str:
    """The LM coverage table and its summary line."""
    built = [r for r in rows if not r.skipped]
    good = [r for r in built if r.coverage is not None and r.coverage >= 0.99]
    lines = [f"{len(built)} of {len(rows)} (family, head) pairs build tiny; {len(good)} of them "
             f"({100 * len(good) / max(len(built), 1):.0f} %) at ≥ 99 % of the parameters.", "",
             "| family | head | by parameter count | exact | fallback reasons |", "|---|---|---|---|---|"]
    for r in rows:
        if r.skipped:
            continue
        why = "; ".join(_short(x).replace("|", "\\|") for x in r.reasons[:3])
        lines.append(f"| {r.family} | {r.kind} | {100 * (r.coverage or 0):.2f} % | {r.exact} | {why} |")
    skipped = [r for r in rows if r.skipped]
    if skipped:
        lines += ["", "Skipped (the tiny config does not build, or its forward fails on the batch):", ""]
        lines += [f"- {r.family} ({r.kind}): {_short(r.skipped, 140).replace('|', '/')}" for r in skipped]
    return "\n".join(lines)


START, END = "<!-- hf_sweep: start -->", "<!-- hf_sweep: end -->"


def write_table(path: str, table: str) -> None:
    """Replace the text between :data:`START` and :data:`END` in ``path`` by ``table``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    i, j = text.find(START), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"{path}: no '{START}' ... '{END}' markers to write the table between")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[: i + len(START)] + "\n" + table + "\n" + text[j:])


def main() -> None:
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=None, help="comma-separated model types (default: all)")
    ap.add_argument("--kind", default="both", choices=["causal", "seqcls", "both"])
    ap.add_argument("--no-check", action="store_true", help="coverage only, no torch.func check")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--write", metavar="PATH", default=None,
                    help="replace the table between the hf_sweep markers of PATH (docs/coverage.md)")
    a = ap.parse_args()
    only = a.families.split(",") if a.families else None
    kinds = ["causal", "seqcls"] if a.kind == "both" else [a.kind]
    rows = []
    for r in sweep(kinds, only, not a.no_check):
        rows.append(r)
        cov = "skipped" if r.skipped else f"{100 * (r.coverage or 0):6.2f} %"
        print(f"{r.family:24s} {r.kind:7s} {cov} {r.exact:10s} {r.skipped or '; '.join(r.reasons[:2])[:200]}",
              file=sys.stderr if a.markdown else sys.stdout, flush=True)
    if a.markdown:
        print(markdown(rows))
    if a.write:
        write_table(a.write, markdown(rows))


if __name__ == "__main__":
    main()
