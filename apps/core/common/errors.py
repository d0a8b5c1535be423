"""The error every part of the app raises for a bad option or input, the one the commands turn
into a one-line message and exit status 2 instead of a traceback."""


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the value and says how to fix it."""


#: The exit status of a command refused for a bad option or input (a configuration error): the
#: launcher does not restart trainers that exit with it, nor do schedulers retry a job that does
#: (a retry would be refused again).
REFUSED = 2
