"""nanoserve: an LLM inference engine written from scratch in PyTorch.

The package is read top to bottom one module at a time; DESIGN.md in the course repo maps the
modules to the days that introduce them.
"""

from nanoserve.errors import GateError, NanoserveError

__version__ = "0.1.0"
__all__ = ["GateError", "NanoserveError", "__version__"]
