"""ART's `art.skypilot` (`from art.skypilot.backend import SkyPilotBackend`): here its
`initialize_cluster` starts a `RayBackend` (backend.py)."""

from art_integrations.skypilot.backend import SkyPilotBackend

__all__ = ["SkyPilotBackend"]
