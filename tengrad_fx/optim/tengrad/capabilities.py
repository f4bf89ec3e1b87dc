"""What a distribution strategy provides, what each option needs, and the one check that
refuses an option a strategy cannot run (at construction, never at a step).

A strategy (:class:`~.distribution.SingleProcess` and its subclasses) says which of
:data:`CAPABILITIES` it lacks and why, in physical terms (:meth:`~.distribution.SingleProcess.lacks`);
each option that is not always run names the capability it needs (:data:`NEEDS`).
:func:`refuse` derives the ``ValueError`` from both: it names the option as given, the
strategy, the capability and the strategy's reason. A strategy that gains an option
lacks one capability fewer; no strategy lists refused options itself.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["CAPABILITIES", "GRAPHS", "NEEDS", "refuse"]

CAPABILITIES: dict[str, str] = {
    "static_buffers": "the gradients live in memory a captured CUDA graph can read again on every replay",
    "graph_collectives": "the collectives of a step on CUDA tensors can be captured in a CUDA graph",
    "compiled_solve": "the compiled update (or the modular path standing in for it) gives the eager update",
    "global_rows": "the rows of the Fisher whose curvature is taken can be chosen among the whole batch's",
    "output_backwards": "the optimizer's own backward passes from the model's output record every layer's G",
    "metric_scaling": "a base metric can scale the records and gradients of every layer solved here",
    "layer_traces": "each layer's Gram trace tr(K_l) sets its damping where its factors are formed",
}
"""Each capability a strategy may lack, with what it means."""

GRAPHS = ("static_buffers", "graph_collectives")
"""The capabilities a step run as a CUDA graph needs (``cuda_graph=None`` turns graphs on
only where a strategy lacks none of them: :attr:`~.distribution.SingleProcess.capturable`)."""

NEEDS: list[tuple[str, str, Callable[[Any], bool], str]] = [
    ("cuda_graph", "static_buffers", lambda v: bool(v), "replays reuse steps reading static gradient buffers"),
    ("compile", "compiled_solve", lambda v: bool(v), "runs the compiled update"),
    ("curvature_samples", "global_rows", lambda v: v is not None, "takes rows of the global batch's Fisher"),
    ("position_rows", "global_rows", lambda v: v is not None, "takes rows of the global batch's Fisher"),
    ("fisher", "output_backwards", lambda v: v == "gauss-newton",
     "runs one backward per model output on curvature steps"),
    ("metric", "metric_scaling", lambda v: bool(v), "scales the records and gradients by a base metric"),
    ("relative_damping", "layer_traces", lambda v: bool(v), "scales each layer's damping by its Gram's trace"),
]
"""``(option, the capability it needs, whether a value asks for it, what it then does)``."""


def refuse(label: str, strategy: str, lacks: dict[str, str], options: dict[str, Any]) -> None:
    """``ValueError`` for the first option of ``options`` (every constructor argument by
    name, :func:`.options.built_options`) whose value needs a capability in ``lacks``
    (``capability: the strategy's reason``); ``label``: the optimizer as users build it,
    ``strategy``: the strategy's name."""
    for option, capability, asks, does in NEEDS:
        if asks(options[option]) and capability in lacks:
            raise ValueError(f"{label}: {option}={options[option]!r} is not supported: {option} {does}, which "
                             f"needs {capability} ({CAPABILITIES[capability]}); {strategy} lacks it: "
                             f"{lacks[capability]}")
