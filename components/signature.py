"""Component functions whose arguments are the fields of typed dataclasses.

TorchX reads a component's arguments from its signature and their help from its docstring.
:func:`component_args` gives a ``def fn(**kwargs) -> specs.AppDef`` the signature and the
``Args:`` docstring section of the dataclasses it is declared with, so the component's
arguments and the app's command line come from the same fields and cannot drift apart.
"""

import dataclasses
import inspect
import typing
from typing import Any, Callable, TypeVar

from torchx import specs
from torchx.specs.finder import ComponentValidationException

from apps.dlrm.options import ConfigError, field_default, help_text, options_of

F = TypeVar("F", bound=Callable[..., specs.AppDef])
D = TypeVar("D")


class InvalidComponentArgument(ConfigError, ComponentValidationException):
    """A component argument is invalid; raised before anything is submitted.

    TorchX's CLI prints it as a one-line error rather than a traceback.
    """


def component_args(*configs: type) -> Callable[[F], F]:
    """Declares the dataclasses whose fields are the keyword arguments of a component."""

    def declare(fn: F) -> F:
        parameters = []
        args_doc = []
        for cls in configs:
            hints = typing.get_type_hints(cls)
            for field in options_of(cls):
                parameters.append(
                    inspect.Parameter(
                        field.name,
                        inspect.Parameter.KEYWORD_ONLY,
                        default=field_default(field),
                        annotation=hints[field.name],
                    )
                )
                args_doc.append(f"    {field.name}: {help_text(field)}")
        names = [p.name for p in parameters]
        duplicated = {n for n in names if names.count(n) > 1}
        assert not duplicated, f"component arguments declared twice: {duplicated}"
        fn.__signature__ = inspect.Signature(parameters, return_annotation=specs.AppDef)
        fn.__doc__ = inspect.cleandoc(fn.__doc__ or fn.__name__) + "\n\nArgs:\n" + "\n".join(args_doc)
        return fn

    return declare


def take(cls: type[D], kwargs: dict[str, Any]) -> D:
    """Builds ``cls`` from the arguments in ``kwargs`` that are its fields (defaults for the rest)."""
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in kwargs.items() if k in names})
    except ConfigError as e:
        raise InvalidComponentArgument(str(e)) from None


def reject_unknown(kwargs: dict[str, Any], *configs: type) -> None:
    known = {f.name for cls in configs for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise InvalidComponentArgument(f"unknown component arguments: {', '.join(unknown)}")
