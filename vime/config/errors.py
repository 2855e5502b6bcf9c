"""The one exception type for bad configuration.

Raised by flag validation anywhere (common or backend); the CLI turns it into a
single ``vime-train: error: ...`` line on stderr and a non-zero exit.
"""


class ConfigError(ValueError):
    """A configuration the run cannot honour; the message says what and how to fix it."""
