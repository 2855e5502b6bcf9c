"""Configuration: flags by group, two-phase parse, cross-flag validation, typed settings.

``parse_args(argv) -> Config`` parses; ``vime.config.settings.build_settings`` turns
the result into each component's frozen settings, the only place outside the CLI
that reads a flag. ``ConfigError`` is what every bad input raises. Parsing imports
no torch and no backend library; ``settings`` (imported by a run, not by parsing)
does.
"""

from vime.config.parser import Config, build_parser, parse_args
from vime.errors import ConfigError

__all__ = ["Config", "ConfigError", "build_parser", "parse_args"]
