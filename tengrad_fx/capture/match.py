"""Which modules the capture pass covers, and the call arguments of their capture op.

A module is *covered* when its forward is exactly ``F.linear`` / ``ConvNd`` /
``ConvTransposeNd`` on its own ``weight`` and ``bias``: ``nn.Linear``, ``nn.Conv1d/2d/3d``,
``nn.ConvTranspose1d/2d/3d`` and subclasses that do not override ``forward`` (plus a short
allowlist of known-exact subclasses), Hugging Face's ``Conv1D`` (a Linear with its weight
stored transposed, ``[d_in, d_out]``), or a norm layer with affine parameters (:mod:`.norm`:
BatchNorm, LayerNorm, GroupNorm, RMSNorm, timm's variants and RMSNorm-shaped modules
recognised by a probe). Everything else is left alone and its parameters fall back to
SGD-momentum, with a reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, cast

import inspect
import operator
import sys

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .embedding import match_embedding
from .norm import match_norm

__all__ = ["LayerSpec", "match_module", "conv_call_args", "spec_args", "module_spec", "is_transposed_linear"]

Kind = Literal["linear", "conv1d", "conv2d", "conv3d",
               "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
               "batchnorm", "layernorm", "groupnorm", "rmsnorm", "layernorm2d", "rmsnorm2d", "param",
               "embedding"]

_BASES: dict[type[nn.Module], Kind] = {
    nn.Linear: "linear",
    nn.Conv1d: "conv1d",
    nn.Conv2d: "conv2d",
    nn.Conv3d: "conv3d",
    nn.ConvTranspose1d: "conv_transpose1d",
    nn.ConvTranspose2d: "conv_transpose2d",
    nn.ConvTranspose3d: "conv_transpose3d",
}


def _exact_subclasses() -> set[type]:
    """Subclasses whose overridden forward is still exactly the base layer."""
    out: set[type] = {nn.modules.linear.NonDynamicallyQuantizableLinear}
    try:  # timm's Linear only differs under torchscript
        from timm.layers import Linear as TimmLinear

        out.add(TimmLinear)
    except Exception:  # pragma: no cover - timm missing or moved
        pass
    return out


def _dynamic_same() -> set[type]:
    """Conv subclasses whose forward pads the input to TF 'SAME' at run time, then runs
    the base conv without padding (timm's ``Conv2dSame``)."""
    try:
        from timm.layers.conv2d_same import Conv2dSame

        return {Conv2dSame}
    except Exception:  # pragma: no cover - timm missing or moved
        return set()


def _hf_conv1d() -> Optional[type[nn.Module]]:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` if transformers is loaded (a
    model holding one has loaded it; the library never imports transformers itself)."""
    mod = sys.modules.get("transformers.pytorch_utils")
    cls = getattr(mod, "Conv1D", None) if mod is not None else None
    return cls if isinstance(cls, type) and issubclass(cls, nn.Module) else None


def is_transposed_linear(mod: nn.Module) -> bool:
    """Whether ``mod`` is a Hugging Face ``Conv1D`` (``y = x @ W + b``, ``W [d_in, d_out]``),
    subclasses included (:func:`match_module` checks their ``forward``)."""
    cls = _hf_conv1d()
    return cls is not None and isinstance(mod, cls)


def _match_transposed_linear(mod: nn.Module) -> tuple[Optional[Kind], str]:
    cls = _hf_conv1d()
    assert cls is not None
    if type(mod).forward is not cls.forward and not type(mod).__dict__.get("_tengrad_capturing", False):
        return None, f"{type(mod).__name__} overrides Conv1D.forward (not provably exact)"
    w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 2 or not (b is None or isinstance(b, nn.Parameter)):
        return None, "Conv1D weight or bias is not a Parameter of the expected shape"
    if b is not None and tuple(b.shape) != (w.shape[1],):
        return None, "Conv1D bias shape does not match its weight [d_in, d_out]"
    return "linear", ""


def pad_same_input(x: Any, kernel: tuple[int, ...], stride: tuple[int, ...],
                   dilation: tuple[int, ...]) -> Any:
    """``x [m, c, h, w]`` padded as timm's ``Conv2dSame`` pads it (asymmetric TF 'SAME')."""
    from timm.layers.padding import pad_same

    return pad_same(x, list(kernel), list(stride), list(dilation))


@dataclass
class LayerSpec:
    """Static facts about one covered module (a *layer*), filled in by :func:`prepare`.

    ``sites`` are the call-site ids of its rewritten calls (several when the module is
    called more than once per forward: weight sharing, treated as extra positions).
    """

    name: str
    kind: Kind
    module: nn.Module
    sites: list[int] = field(default_factory=list)
    # conv only
    stride: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()
    dilation: tuple[int, ...] = ()
    groups: int = 1
    pre_pad: Optional[tuple[int, ...]] = None
    pad_mode: str = "constant"
    transposed: bool = False  # ConvTransposeNd: weight [c_in, c_out/g, *k]; linear: weight [d_in, d_out]
    output_padding: tuple[int, ...] = ()
    dynamic_same: bool = False  # pad_same_input() before the conv (timm Conv2dSame)
    # probed shapes of the (padded) inputs, per site, at the probe's batch size
    input_shapes: list[tuple[int, ...]] = field(default_factory=list)
    # embedding, and a Linear tied to embeddings (:mod:`.sharing`): the lookups tied to
    # this host spec until merge_tied_lookups folds their sites in, then their names
    tied_lookups: list[LayerSpec] = field(default_factory=list, repr=False, compare=False)
    tied_names: list[str] = field(default_factory=list)
    # a module swapped by surgery inside a module the fx graph keeps as a leaf
    in_leaf: bool = False
    # "param" made by module surgery (:mod:`.added_params`): its per-sample use is checked
    surgery: bool = False
    # every kind, once dropped to the fallback (:func:`.sharing.drop_layer`): the sites its
    # calls still run (recorded nothing), the reason for the layer, per-parameter reasons
    dropped_sites: list[int] = field(default_factory=list)
    fallback_reason: str = ""
    param_reasons: dict[int, str] = field(default_factory=dict)  # id(parameter) -> reason

    @property
    def weight(self) -> Any:
        return self.module.weight

    @property
    def bias(self) -> Any:
        return getattr(self.module, "bias", None)  # RMSNorm has none


def match_module(mod: nn.Module) -> tuple[Optional[Kind], str]:
    """``(kind, "")`` if ``mod`` is covered, else ``(None, reason)``."""
    for base, kind in _BASES.items():
        if isinstance(mod, base):
            cls = type(mod)
            if cls.forward is not base.forward and not _exact_override(mod, kind):
                return None, f"{cls.__name__} overrides {base.__name__}.forward (not provably exact)"
            if kind != "linear" and bool(getattr(mod, "transposed", False)) != kind.startswith("conv_transpose"):
                return None, "convolution with a non-standard 'transposed' flag"
            if not isinstance(mod.weight, nn.Parameter):
                return None, "weight is not a Parameter"
            return kind, ""
    if is_transposed_linear(mod):
        return _match_transposed_linear(mod)
    norm_kind, why = match_norm(mod)
    if norm_kind == "rmsnorm" and _extra_forward_args(mod):
        return None, (f"{type(mod).__name__}: RMSNorm-shaped, but its forward takes more than the input "
                      f"({', '.join(_extra_forward_args(mod))}; not provably exact)")
    if norm_kind is not None or why:
        return cast(Optional[Kind], norm_kind), why  # one of norm.NORM_KINDS
    emb_kind, why = match_embedding(mod)
    return cast(Optional[Kind], emb_kind), why  # "embedding" or None


def _extra_forward_args(mod: nn.Module) -> list[str]:
    """The parameters of ``type(mod).forward`` after the input (a gated RMSNorm's ``gate``:
    a structural match, probed on the input alone, says nothing about them)."""
    try:
        params = list(inspect.signature(type(mod).forward).parameters.values())[2:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params]


def _exact_override(mod: nn.Module, kind: Kind) -> bool:
    """An overriding subclass whose forward is still exactly its base layer."""
    cls = type(mod)
    return cls in _exact_subclasses() | _dynamic_same() or (kind == "linear" and forward_is_linear(mod))


def forward_is_linear(mod: nn.Module) -> bool:
    """Whether a Linear subclass's own ``forward`` is provably ``F.linear(x, weight, bias)``:
    traced by ``torch.fx`` on one input ``x [..., d_in]``, its graph is exactly one of
    ``linear(x, W[, b])``, ``x @ Wᵀ`` or ``x @ Wᵀ + b`` (``Wᵀ`` as ``W.T``, ``W.t()``,
    ``W.transpose(0, 1)``), on the module's own ``weight`` and ``bias`` (Falcon's
    ``FalconLinear``). Cached per class and bias presence."""
    key = (type(mod), getattr(mod, "bias", None) is None)
    if key not in _LINEAR_FORWARD:
        try:
            graph = fx.Tracer().trace(mod)
        except Exception:
            graph = None
        _LINEAR_FORWARD[key] = graph is not None and _is_linear_graph(graph, key[1])
    return _LINEAR_FORWARD[key]


_LINEAR_FORWARD: dict[tuple[type, bool], bool] = {}


def _is_linear_graph(graph: fx.Graph, no_bias: bool) -> bool:
    """The graph of :func:`forward_is_linear`: placeholder ``x``, then only the nodes of one
    accepted form (nothing else computed), its value returned."""
    nodes = list(graph.nodes)
    xs = [n for n in nodes if n.op == "placeholder"]
    outs = [n for n in nodes if n.op == "output"]
    if len(xs) != 1 or len(outs) != 1 or not isinstance(outs[0].args[0], fx.Node):
        return False
    x, y = xs[0], outs[0].args[0]
    used: set[fx.Node] = {x, outs[0]}

    def attr(n: object, name: str) -> bool:
        ok = isinstance(n, fx.Node) and n.op == "get_attr" and n.target == name
        if ok:
            used.add(n)  # type: ignore[arg-type]
        return ok

    def transposed_weight(n: object) -> bool:
        if not isinstance(n, fx.Node):
            return False
        used.add(n)
        if n.op == "call_function" and n.target is getattr and n.args[1] in ("T", "mT"):
            return attr(n.args[0], "weight")
        if n.op == "call_method" and n.target == "t" or n.op == "call_function" and n.target is torch.t:
            return len(n.args) == 1 and attr(n.args[0], "weight")
        if n.op == "call_method" and n.target == "transpose" or n.op == "call_function" and n.target is torch.transpose:
            dims = [a % 2 for a in n.args[1:] if isinstance(a, int)]
            return len(n.args) == 3 and sorted(dims) == [0, 1] and attr(n.args[0], "weight")
        return False

    def core(n: object, with_bias: bool) -> bool:
        if not isinstance(n, fx.Node) or n.op != "call_function":
            return False
        used.add(n)
        if n.target in (F.linear, torch._C._nn.linear):
            args = [*n.args, *n.kwargs.values()]
            b = args[2] if len(args) > 2 else None
            return len(args) <= 3 and args[0] is x and attr(args[1], "weight") and \
                ((b is None) if not with_bias else attr(b, "bias"))
        if n.target in (operator.matmul, torch.matmul) and not with_bias:
            return n.args[0] is x and transposed_weight(n.args[1]) and not n.kwargs
        return False

    if no_bias:
        ok = core(y, False)
    elif isinstance(y, fx.Node) and y.op == "call_function" and y.target in (operator.add, torch.add) \
            and len(y.args) == 2 and not y.kwargs:
        used.add(y)
        a, b = y.args
        ok = (core(a, False) and attr(b, "bias")) or (core(b, False) and attr(a, "bias"))
    else:
        ok = core(y, True)
    return ok and used == set(nodes)


def spec_args(mod: nn.Module, kind: str) -> dict[str, Any]:
    """The :class:`LayerSpec` fields a covered module of ``kind`` needs beyond its name:
    :func:`conv_call_args` for convolutions, ``transposed=True`` for a Hugging Face
    ``Conv1D`` (a Linear whose weight is ``[d_in, d_out]``), none for the other kinds."""
    if kind.startswith("conv"):
        return conv_call_args(mod)
    if kind == "linear" and is_transposed_linear(mod):
        return dict(transposed=True)
    return {}


def module_spec(name: str, mod: nn.Module, **fields: Any) -> LayerSpec:
    """The :class:`LayerSpec` of the covered module ``mod`` (:func:`match_module` says
    which), with its :func:`spec_args` and the other ``fields`` given."""
    kind, why = match_module(mod)
    if kind is None:
        raise ValueError(f"module '{name}' ({type(mod).__name__}) is not covered: {why}")
    return LayerSpec(name=name, kind=kind, module=mod, **fields, **spec_args(mod, kind))


def conv_call_args(mod: nn.Module) -> dict[str, Any]:
    """Normalized capture-op arguments for a ConvNd / ConvTransposeNd module.

    Returns ``stride, padding, dilation, groups`` as explicit int tuples, and
    ``pre_pad``/``pad_mode`` when the input must be padded before an unpadded conv
    (``padding_mode`` other than ``'zeros'``, or an asymmetric ``padding='same'``);
    for a transposed convolution (zeros padding only, as in torch) also
    ``transposed=True`` and ``output_padding``.
    """
    conv = cast(nn.modules.conv._ConvNd, mod)  # a ConvNd / ConvTransposeNd, or a stand-in with its attributes
    k, dil, stride = tuple(conv.kernel_size), tuple(conv.dilation), tuple(conv.stride)
    nd = len(k)
    pad = conv.padding
    if getattr(mod, "transposed", False):
        assert not isinstance(pad, str), "ConvTransposeNd has no string padding"
        return dict(stride=stride, padding=tuple(int(p) for p in pad),
                    dilation=dil, groups=conv.groups, pre_pad=None, pad_mode="constant",
                    transposed=True, output_padding=tuple(conv.output_padding))
    if pad == "valid":
        lr = [(0, 0)] * nd
    elif pad == "same":
        lr = []
        for d in range(nd):
            total = dil[d] * (k[d] - 1)
            left = total // 2
            lr.append((left, total - left))
    else:
        lr = [(int(p), int(p)) for p in pad]
    mode = conv.padding_mode
    if mode != "zeros":
        f_mode = {"reflect": "reflect", "replicate": "replicate", "circular": "circular"}.get(mode)
        if f_mode is None:
            raise ValueError(f"unsupported padding_mode {mode!r}")
        pre = tuple(v for l, r in reversed(lr) for v in (l, r))
        return dict(stride=stride, padding=(0,) * nd, dilation=dil, groups=conv.groups,
                    pre_pad=pre, pad_mode=f_mode)
    if type(mod) in _dynamic_same():
        return dict(stride=stride, padding=(0,) * nd, dilation=dil, groups=conv.groups,
                    pre_pad=None, pad_mode="constant", dynamic_same=True)
    if all(l == r for l, r in lr):
        return dict(stride=stride, padding=tuple(l for l, _ in lr), dilation=dil,
                    groups=conv.groups, pre_pad=None, pad_mode="constant")
    # asymmetric 'same': symmetric part in the conv, the extra on the right pre-padded
    sym = tuple(l for l, _ in lr)
    pre = tuple(v for l, r in reversed(lr) for v in (0, r - l))
    return dict(stride=stride, padding=sym, dilation=dil, groups=conv.groups,
                pre_pad=pre, pad_mode="constant")
