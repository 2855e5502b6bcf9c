"""The one exception type for bad configuration.

Raised by flag validation anywhere (common or backend); the CLI turns it into a
single ``vime-train: error: ...`` line on stderr and a non-zero exit. It sits
outside ``vime.config`` (which re-exports it) because every layer raises it, and
importing ``vime.config`` runs its parser and validation: a module the
validation imports could not otherwise import it without a circle.
"""


class ConfigError(ValueError):
    """A configuration the run cannot honour; the message says what and how to fix it."""
