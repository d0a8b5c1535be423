"""The error every part of the app raises for a bad option or input, the one the commands turn
into a one-line message and exit status 2 instead of a traceback."""


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the value and says how to fix it."""
