"""Monitor-driven actions: plateau / non-finite rules, the control channel, lr scaling."""
from .engine import ActionEngine

__all__ = ["ActionEngine"]
