"""Configuration: flags by group, two-phase parse, cross-flag validation.

``parse_args(argv) -> Config`` is the whole interface; ``ConfigError`` is what
every bad input raises. Nothing here imports torch or a backend library.
"""

from vime.config.parser import Config, build_parser, parse_args
from vime.errors import ConfigError

__all__ = ["Config", "ConfigError", "build_parser", "parse_args"]
