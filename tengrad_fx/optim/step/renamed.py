"""Renamed keyword options: the old name keeps working for a while, with a
``DeprecationWarning`` that names the new one; giving both is a ``TypeError``.

``@renamed_keywords(TCov="curvature_every")`` on a constructor maps old keyword names to
new ones before the call (``inspect.signature`` shows the new signature); the map is kept
on the wrapper (:func:`renamed_of` of the class) so that other entry points, e.g.
:func:`tengrad_fx.optim.registry.make_optimizer`, translate user options the same way.
``TCov = RenamedAttribute("curvature_every")`` in a class body keeps the old attribute
name readable and writable, with the same warning.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Mapping, TypeVar, cast

__all__ = ["RenamedAttribute", "rename_keywords", "renamed_keywords", "renamed_of"]

F = TypeVar("F", bound=Callable[..., Any])
_ATTR = "__renamed_keywords__"


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


def renamed_keywords(**renamed: str) -> Callable[[F], F]:
    """Decorator of ``__init__``: accept the old keyword names ``renamed`` (``old=new``), see
    :func:`rename_keywords`. The owner named in messages is the instance's class."""
    def decorate(init: F) -> F:
        @functools.wraps(init)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not renamed.keys() & kwargs.keys():
                return init(self, *args, **kwargs)
            return init(self, *args, **rename_keywords(kwargs, renamed, type(self).__name__, stacklevel=3))
        setattr(wrapper, _ATTR, dict(renamed))
        return cast(F, wrapper)
    return decorate


def renamed_of(cls: type) -> dict[str, str]:
    """``{old: new}`` of ``cls``'s constructor if it is :func:`renamed_keywords`' (``{}`` otherwise)."""
    init = next(vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k))
    return dict(getattr(init, _ATTR, {}))


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
