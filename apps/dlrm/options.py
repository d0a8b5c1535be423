"""Typed dataclass fields that double as command-line options.

A field declared with :func:`option` carries its help text and allowed choices. The same field
then builds the app's ``argparse`` parser (:func:`build_parser`) and the TorchX component's
signature (``components/signature.py``), and :func:`to_argv` turns a dataclass back into the
command line the app parses. Values use one text form everywhere, the one TorchX's CLI already
uses: lists are comma separated (``64,32,1``), booleans are ``true``/``false``. The app's parser
and the component (``components/signature.py``) read that text with the same :func:`value_parser`,
so a value one accepts the other accepts too, and one refuses the other refuses.
"""

import argparse
import copy
import dataclasses
import math
import typing
from typing import Any, Callable, Sequence, TypeVar

from apps.dlrm.common.errors import ConfigError

T = TypeVar("T")


def option(default: Any, help: str, *, choices: Sequence[str] | None = None) -> Any:
    """A dataclass field with a default, a help text and optional allowed choices."""
    metadata = {"help": help, "choices": tuple(choices) if choices else None}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.copy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def check_choices(config: Any) -> None:
    """Refuses a field of the dataclass ``config`` whose value is not one of its choices.

    argparse checks choices on the app's command line; this also covers a dataclass built
    from TorchX component arguments or in code.
    """
    for field in options_of(type(config)):
        choices = field.metadata.get("choices")
        value = getattr(config, field.name)
        if choices and value not in choices:
            raise ConfigError(f"--{field.name} {value!r} is not supported: use one of {', '.join(choices)}")


TRUE_TEXTS = ("true", "yes", "on", "1")
FALSE_TEXTS = ("false", "no", "off", "0")


def parse_bool(text: str) -> bool:
    """``true``/``false`` (or yes/no, on/off, 1/0, any case); anything else is refused, never false."""
    lowered = text.strip().lower()
    if lowered in TRUE_TEXTS:
        return True
    if lowered in FALSE_TEXTS:
        return False
    raise argparse.ArgumentTypeError(
        f"expected true or false ({'/'.join(TRUE_TEXTS[1:])} or {'/'.join(FALSE_TEXTS[1:])} also work), got {text!r}"
    )


def parse_finite_float(text: str) -> float:
    """A float that arithmetic can use: ``nan`` and ``inf`` pass every range check and then
    poison training, so they are refused here, where the text is read."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _list_parser(element: Callable[[str], Any]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        try:
            return [element(item) for item in items]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {element.__name__}, got {text!r}"
            ) from None

    parse.__name__ = f"list[{element.__name__}]"
    return parse


def value_parser(annotation: Any) -> Callable[[str], Any]:
    """The function that turns the text form of a value of type ``annotation`` into the value."""
    if annotation is bool:
        return parse_bool
    if typing.get_origin(annotation) is list:
        (element,) = typing.get_args(annotation)
        return _list_parser(element)
    if annotation is float:
        return parse_finite_float
    if annotation in (int, str):
        return annotation
    raise TypeError(f"options of type {annotation!r} are not supported")


def format_value(value: Any) -> str:
    """The text form of ``value``, as :func:`value_parser` reads it back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    return str(value)


def options_of(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def help_text(field: dataclasses.Field) -> str:
    choices = field.metadata.get("choices")
    text = field.metadata["help"]
    return f"{text} One of: {', '.join(choices)}." if choices else text


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one ``--name`` option per field of the dataclass ``cls`` to ``parser``."""
    hints = typing.get_type_hints(cls)
    for field in options_of(cls):
        annotation = hints[field.name]
        kwargs: dict[str, Any] = {
            "type": value_parser(annotation),
            "default": field_default(field),
            "help": help_text(field),
            "metavar": field.name.upper() if annotation is not bool else "true|false",
        }
        if annotation is bool:
            kwargs["nargs"] = "?"
            kwargs["const"] = True
        if field.metadata.get("choices"):
            kwargs["choices"] = field.metadata["choices"]
            kwargs["metavar"] = "{" + ",".join(field.metadata["choices"]) + "}"
        parser.add_argument(f"--{field.name}", **kwargs)


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_options(parser, cls)
    return parser


def parse_config(cls: type[T], argv: Sequence[str] | None, prog: str, description: str) -> T:
    """Parses ``argv`` into a validated ``cls``; a bad value exits with a message naming it."""
    parser = build_parser(cls, prog, description)
    namespace = parser.parse_args(argv)
    try:
        return cls(**vars(namespace))
    except ConfigError as e:
        parser.error(str(e))


def to_argv(config: Any, only_changed: bool = True) -> list[str]:
    """The command line that :func:`parse_config` turns back into ``config``."""
    argv: list[str] = []
    for field in options_of(type(config)):
        value = getattr(config, field.name)
        if only_changed and value == field_default(field):
            continue
        argv += [f"--{field.name}", format_value(value)]
    return argv
