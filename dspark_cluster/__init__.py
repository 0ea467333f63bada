"""DSpark Cluster: serve Mixture-of-Experts models with tensor / expert parallelism, continuous
batching and speculative decoding. The core runs without Ray; `actors/` wraps it for a cluster."""

from .config import Config, load_config
from .errors import CheckpointError, ConfigError, DSparkError, RequestError
from .llm import LLM
from .outputs import RequestOutput, StreamPiece
from .sampling import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "StreamPiece",
    "Config",
    "load_config",
    "ConfigError",
    "CheckpointError",
    "RequestError",
    "DSparkError",
]
