"""`art-backend view`: a read-only web page over the trajectories a backend stored.

`store` reads the art dir, `curve` draws the reward curve, `conversation` and `tokens` prepare a
trajectory's turns and training tokens for display, `app` serves the pages.
"""

from art_backend.viewer.app import create_viewer_app
from art_backend.viewer.tokens import Tokenizers

__all__ = ["Tokenizers", "create_viewer_app"]
