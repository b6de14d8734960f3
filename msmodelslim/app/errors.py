"""The app layer's error type (defined once in `msmodelslim.errors` so core modules can raise it too)."""

from msmodelslim.errors import UserError

__all__ = ["UserError"]
