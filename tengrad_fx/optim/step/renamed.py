"""Renamed keyword options: the old name keeps working for a while, with a
``DeprecationWarning`` that names the new one; giving both is a ``TypeError``.

``@renamed_keywords(TCov="curvature_every")`` on a constructor maps old keyword names to
new ones before the call (``inspect.signature`` shows the new signature); the map is kept
on the wrapper (:func:`renamed_of` of the class) so that other entry points, e.g.
:func:`tengrad_fx.optim.registry.make_optimizer`, translate user options the same way
(:func:`respell_of`). ``@respelled_keywords(respell)`` is the general form: ``respell``
maps the keywords given to the constructor's own (e.g. a deprecated grouping object to
the flat keywords it stands for).
``TCov = RenamedAttribute("curvature_every")`` in a class body keeps the old attribute
name readable and writable, with the same warning.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Mapping, TypeVar, cast

__all__ = ["RenamedAttribute", "Respell", "rename_keywords", "renamed_keywords", "renamed_of", "respell_of",
           "respelled_keywords"]

F = TypeVar("F", bound=Callable[..., Any])
_ATTR = "__renamed_keywords__"
_RESPELL = "__respell_keywords__"
Respell = Callable[[Mapping[str, Any], str, int], dict[str, Any]]
"""``respell(kwargs, owner, stacklevel)``: ``kwargs`` in the constructor's own spelling; its
warnings take ``stacklevel`` as counted from ``respell`` itself (2: its caller)."""


def rename_keywords(kwargs: Mapping[str, Any], renamed: Mapping[str, str], owner: str,
                    stacklevel: int = 3) -> dict[str, Any]:
    """A copy of ``kwargs`` with each old name of ``renamed`` (``{old: new}``) replaced by
    its new name. Each old name found warns ``DeprecationWarning`` (``stacklevel`` counts
    from this function's caller's caller, i.e. the user's call when called from a wrapper);
    an old name given together with its new name is a ``TypeError`` naming both."""
    out = dict(kwargs)
    for old, new in renamed.items():
        if old not in out:
            continue
        if new in out:
            raise TypeError(f"{owner}: got both {old!r} and {new!r}; {old!r} is the deprecated name of "
                            f"{new!r}: pass only {new}={out[new]!r}")
        warnings.warn(f"{owner}: the option {old!r} is deprecated; pass {new!r} instead",
                      DeprecationWarning, stacklevel=stacklevel)
        out[new] = out.pop(old)
    return out


def respelled_keywords(respell: Respell) -> Callable[[F], F]:
    """Decorator of ``__init__``: the keywords pass through ``respell`` (the owner named in
    its messages: the instance's class) before the call; kept for :func:`respell_of`."""
    def decorate(init: F) -> F:
        @functools.wraps(init)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            return init(self, *args, **respell(kwargs, type(self).__name__, 3))
        setattr(wrapper, _RESPELL, respell)
        return cast(F, wrapper)
    return decorate


def renamed_keywords(**renamed: str) -> Callable[[F], F]:
    """Decorator of ``__init__``: accept the old keyword names ``renamed`` (``old=new``), see
    :func:`rename_keywords`. The owner named in messages is the instance's class."""
    def respell(kwargs: Mapping[str, Any], owner: str, stacklevel: int) -> dict[str, Any]:
        return rename_keywords(kwargs, renamed, owner, stacklevel + 1)

    def decorate(init: F) -> F:
        wrapper = respelled_keywords(respell)(init)
        setattr(wrapper, _ATTR, dict(renamed))
        return wrapper
    return decorate


def _init(cls: type) -> Any:
    """The ``__init__`` ``cls`` runs (its own or the nearest base's)."""
    return next(vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k))


def renamed_of(cls: type) -> dict[str, str]:
    """``{old: new}`` of ``cls``'s constructor if it is :func:`renamed_keywords`' (``{}`` otherwise)."""
    return dict(getattr(_init(cls), _ATTR, {}))


def respell_of(cls: type, kwargs: Mapping[str, Any], stacklevel: int = 3) -> dict[str, Any]:
    """``kwargs`` in ``cls``'s constructor's spelling, as its :func:`respelled_keywords`
    (or :func:`renamed_keywords`) decorator maps them (a copy, unchanged without one);
    ``stacklevel`` counts from this function (3: its caller's caller)."""
    respell: Respell | None = getattr(_init(cls), _RESPELL, None)
    return dict(kwargs) if respell is None else respell(kwargs, cls.__name__, stacklevel + 1)


class RenamedAttribute:
    """Class attribute ``old = RenamedAttribute(new)``: ``obj.old`` reads and writes
    ``obj.new``, with a ``DeprecationWarning`` naming ``new``."""

    def __init__(self, new: str):
        self.new = new
        self.old = new

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = name

    def _warn(self, obj: Any) -> None:
        warnings.warn(f"{type(obj).__name__}.{self.old} is deprecated; use {self.new!r} instead",
                      DeprecationWarning, stacklevel=3)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        self._warn(obj)
        return getattr(obj, self.new)

    def __set__(self, obj: Any, value: Any) -> None:
        self._warn(obj)
        setattr(obj, self.new, value)
