"""Models vime builds in code rather than loads: the embedded default of ``vime-train``."""

from vime.models.embedded import write_embedded_checkpoint

__all__ = ["write_embedded_checkpoint"]
