"""Client side of ART integrations: capture agent rollouts and train them on an art-backend.

This package stays light (no torch): it talks to the backend over HTTP.
"""

__version__ = "0.1.0"
