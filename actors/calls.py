"""Ray calls, with Ray's errors unwrapped one way for the whole Ray side.

A remote method that raises has its exception wrapped by Ray in a RayTaskError; `remote_error`
gives it back as itself (an instance of its own class, Ray's remote traceback in its text). Ray's
own failures (a dead actor or node, a timeout, a closed channel) have no such cause. The rule:

- the remote code raised one of this package's errors (DSparkError: ConfigError, CheckpointError,
  RequestError, ...): it is raised as itself (the original exception, its message without Ray's
  traceback: these messages are written for users);
- it raised anything else: `failed(e)` when the caller gives one, else Ray's error as it is;
- Ray failed: `lost(e)` when the caller gives one, else Ray's error as it is.
"""

from __future__ import annotations

from typing import Callable, Optional

from dspark_cluster.errors import DSparkError


def remote_error(e: BaseException) -> Optional[BaseException]:
    """The exception the remote code raised, when `e` is Ray's wrapping of one; None otherwise."""
    from ray.exceptions import RayTaskError

    if isinstance(e, RayTaskError):
        return e.as_instanceof_cause()
    return None


def unwrap(e: BaseException, failed: Optional[Callable] = None, lost: Optional[Callable] = None) -> BaseException:
    """What to raise for a Ray error `e` (the rule above)."""
    from ray.exceptions import RayError

    if isinstance(getattr(e, "cause", None), DSparkError):
        return e.cause  # the error itself: its message is meant for users, without Ray's traceback
    if remote_error(e) is not None:
        return failed(e) if failed is not None else e
    if isinstance(e, RayError) and lost is not None:
        return lost(e)
    return e


def ray_get(refs, timeout=None, failed: Optional[Callable] = None, lost: Optional[Callable] = None):
    """ray.get, its Ray errors unwrapped by the rule above (other exceptions pass as they are)."""
    import ray
    from ray.exceptions import RayError

    try:
        return ray.get(refs, timeout=timeout)
    except RayError as e:
        err = unwrap(e, failed, lost)
        if err is e:
            raise
        raise err from None
