"""Component functions whose arguments are the fields of typed dataclasses.

TorchX reads a component's arguments from its signature and their help from its docstring.
:func:`component_args` gives a ``def fn(**kwargs) -> specs.AppDef`` the signature and the
``Args:`` docstring section of the dataclasses it is declared with, so the component's
arguments and the app's command line come from the same fields and cannot drift apart.

TorchX decodes a component argument by its annotation, and for some types not as the app does:
any boolean text but ``true`` becomes false (``--shuffle yes`` would silently turn shuffling
off), ``nan`` passes as a float, and a malformed ``--env`` or list fails in TorchX with a
traceback. So only the types TorchX reads as the app does (int, str) keep their annotation; the
others are declared as text, and :func:`take` parses that text with the app's own parsers.
"""

import argparse
import dataclasses
import inspect
import typing
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from torchx import specs
from torchx.specs.finder import ComponentValidationException
from torchx.util.types import to_dict

from apps.core.options import (
    ConfigError,
    Options,
    field_default,
    given_options,
    help_text,
    option_types,
    options_of,
    value_parser,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance  # exists only for type checkers

F = TypeVar("F", bound=Callable[..., specs.AppDef])
D = TypeVar("D", bound="DataclassInstance")

#: Annotations TorchX decodes exactly as the app's command line does.
_DECODED_BY_TORCHX = (int, str, str | None)


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
            hints = option_types(cls)
            for field in options_of(cls):
                parameters.append(
                    inspect.Parameter(
                        field.name,
                        inspect.Parameter.KEYWORD_ONLY,
                        default=field_default(field),
                        annotation=_as_component_annotation(hints[field.name]),
                    )
                )
                args_doc.append(f"    {field.name}: {help_text(field)}")
        names = [p.name for p in parameters]
        duplicated = {n for n in names if names.count(n) > 1}
        assert not duplicated, f"component arguments declared twice: {duplicated}"
        # What inspect.signature (and so TorchX) reads; a function attribute that mypy does not model,
        # hence setattr.
        setattr(fn, "__signature__", inspect.Signature(parameters, return_annotation=specs.AppDef))  # noqa: B010
        fn.__doc__ = inspect.cleandoc(fn.__doc__ or fn.__name__) + "\n\nArgs:\n" + "\n".join(args_doc)
        return fn

    return declare


def take(cls: type[D], kwargs: dict[str, Any]) -> D:
    """Builds ``cls`` from the arguments in ``kwargs`` that are its options (defaults for the rest).

    Arguments still in their text form (from TorchX's CLI or a .torchxconfig) are parsed here.
    TorchX hands every argument over, given or not; for a configuration of sections
    (:class:`~apps.core.options.Options`) those that differ from their default count as given,
    so a --preset fills the others (an argument given at its default value cannot be told apart
    here, unlike on the app's own command line).
    """
    hints = option_types(cls)
    names = argument_names(cls)
    try:
        for name in names & set(kwargs):
            _refuse_macros(name, kwargs[name])
        values = {k: _from_text(k, hints[k], v) for k, v in kwargs.items() if k in names}
        if issubclass(cls, Options):
            return cls.from_options(given_options(cls, values))
        return cls(**values)
    except ConfigError as e:
        raise InvalidComponentArgument(str(e)) from None


#: Replaces TorchX's macros ($app_id, ${replica_id}, ...) and $$ in a text, as every scheduler does
#: to a role's arguments and environment; the placeholder values only show that it changed.
_MACROS = specs.macros.Values(img_root="\0", app_id="\0", replica_id="\0", rank0_env="\0")


def _refuse_macros(name: str, value: Any) -> None:
    """Refuses text that TorchX would silently rewrite on its way to the trainers."""
    texts = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
    for text in texts:
        if isinstance(text, str) and _MACROS.substitute(text) != text:
            raise ConfigError(
                f"--{name} {text!r}: TorchX replaces $$ and $app_id, $replica_id, $img_root, "
                "$rank0_env (also as ${...}) in every argument on every scheduler; write the value "
                "without them"
            )


def _as_component_annotation(annotation: Any) -> Any:
    return annotation if annotation in _DECODED_BY_TORCHX else str


def _from_text(name: str, annotation: Any, value: Any) -> Any:
    """``value`` of the field ``name``, parsed if TorchX handed it over as text."""
    if annotation in _DECODED_BY_TORCHX or not isinstance(value, str):
        return value
    parse = _parse_dict if typing.get_origin(annotation) is dict else value_parser(annotation)
    try:
        return parse(value)
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise ConfigError(f"--{name}: {e}") from None  # the parsers' messages quote the value


def _parse_dict(text: str) -> dict[str, str]:
    """``KEY=VALUE,KEY2=VALUE2``, read as TorchX reads it (quotes keep ``,`` and ``=`` in a value)."""
    try:
        return to_dict(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE pairs separated by commas (e.g. NCCL_DEBUG=INFO,FOO=bar), got {text!r}"
        ) from None


def argument_names(cls: type[Any]) -> set[str]:
    """The component arguments ``cls`` takes: a configuration's options, its sections' included
    (not the sections' own names), or a plain dataclass's fields."""
    fields = options_of(cls) if issubclass(cls, Options) else dataclasses.fields(cls)
    return {field.name for field in fields}


def reject_unknown(kwargs: dict[str, Any], *configs: type) -> None:
    known = set().union(*(argument_names(cls) for cls in configs))
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise InvalidComponentArgument(f"unknown component arguments: {', '.join(unknown)}")
