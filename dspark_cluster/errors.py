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
        # a ConfigError's problems (one raised inside another check's) are listed once each
        self.problems = [q for p in problems for q in (p.problems if isinstance(p, ConfigError) else [p])]
        if len(self.problems) == 1:  # one problem, one line
            super().__init__(f"invalid configuration: {self.problems[0]}")
            return
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problems):\n{lines}")

    def __reduce__(self):  # pickled (across Ray) as its problems, not as its message (which would nest)
        return (type(self), (self.problems,))


class CheckpointError(DSparkError, ValueError):
    """A checkpoint cannot be used: unsupported architecture, missing tensor, bad shape."""


class RequestError(DSparkError, ValueError):
    """A request is invalid: bad prompt or sampling parameters. Other requests keep running."""


class PromptError(RequestError):
    """The prompt is refused (empty, ids outside the vocabulary, too long): the one check of it, in
    `input_processor.py`, for `LLM` and the HTTP server alike (which answers naming the field sent)."""


class PromptTooLongError(PromptError):
    """The prompt leaves no room in the context (max_model_len) for a new token."""


class EngineError(DSparkError):
    """The engine (not the request) failed: a worker died, or it is restarting or stopped.
    The message is safe to show to clients."""


class WorkerError(EngineError):
    """A target worker died or stopped answering. The engine restarts the workers (up to
    `parallel.max_restarts`) and re-runs the requests in flight; the cause goes to the log."""


class StepError(EngineError):
    """A step failed for a reason other than a lost worker (an error raised while building or running
    it): the requests in that step fail, the engine and every other request go on. `request_ids`
    names them; the cause (chained) goes to the log, not to clients."""

    def __init__(self, request_ids, cause: BaseException):
        self.request_ids = list(request_ids)
        super().__init__(f"the step running this request failed ({type(cause).__name__}); other requests "
                         "continue; see the server log")
