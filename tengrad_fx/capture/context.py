"""What the graph rewriters of one :func:`~.prepare.prepare` call share."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from .match import LayerSpec
from .store import CaptureStore

__all__ = ["RewriteContext"]


@dataclass
class RewriteContext:
    """The state the fx rewriters (covered modules, functional layers, attention, added
    parameters, modules inside leaves) build up together, over the train and the eval graph.

    Site ids are handed out by :meth:`new_site`; ``store.n_sites`` is their count so far.
    """

    model: nn.Module  # the traced model: owner of every module and parameter the graphs name
    store: CaptureStore  # ``store.key`` goes into every capture call
    candidates: dict[str, nn.Module]  # covered modules by qualified name
    fallback: dict[str, str]  # parameter name -> why it falls back (filled in place)
    runtime_batch: bool  # no example inputs: capture ops check the batch size at run time
    added_params: bool = True  # also cover functional layers, attention and added parameters
    layers: dict[str, LayerSpec] = field(default_factory=dict)  # layer name -> its spec
    odd: set[str] = field(default_factory=set)  # candidates also called with another signature
    refused: dict[str, str] = field(default_factory=dict)  # added parameter -> why not covered

    @property
    def key(self) -> int:
        """The key of :attr:`store` (the capture ops' argument)."""
        return self.store.key

    @property
    def layer_params(self) -> set[int]:
        """ids of the candidates' own parameters (not added parameters)."""
        return {id(p) for mod in self.candidates.values() for p in mod.parameters(recurse=False)}

    def new_site(self) -> int:
        """A fresh call-site id."""
        site = self.store.n_sites
        self.store.n_sites += 1
        return site
