"""ART's module path for the local backend: `from art.local import LocalBackend` ports as
`from art_integrations.local import LocalBackend`."""

from art_integrations.backend import LocalBackend

__all__ = ["LocalBackend"]
