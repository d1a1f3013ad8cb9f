"""ART's module path for its helpers: `from art.utils import iterate_dataset` ports as
`from art_integrations.utils import iterate_dataset`."""

from art_integrations.dataset import DatasetBatch, iterate_dataset
from art_integrations.retry import retry

__all__ = ["DatasetBatch", "iterate_dataset", "retry"]
