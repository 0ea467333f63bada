"""The project's exception types: one per kind of bad input."""


class DSparkError(Exception):
    """Base class for every error this package raises on purpose."""


class ConfigError(DSparkError, ValueError):
    """A configuration (YAML, dict, --set override) is invalid.

    `problems` lists every problem found, each naming the key path, the bad value and the fix.
    """

    def __init__(self, problems):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


class CheckpointError(DSparkError, ValueError):
    """A checkpoint cannot be used: unsupported architecture, missing tensor, bad shape."""


class RequestError(DSparkError, ValueError):
    """A request is invalid: bad prompt or sampling parameters. Other requests keep running."""
