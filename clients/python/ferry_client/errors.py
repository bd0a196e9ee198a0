"""Ferry's errors as Python exceptions: every answer Ferry refuses carries a stable code
(``FERRY_APP_NOT_FOUND``), kept here with the HTTP status, the message and the run id when there is one."""

from typing import Optional


class FerryError(Exception):
    """An error Ferry answered (``code`` is Ferry's, docs/errors.md), or one of the client's own
    (``FERRY_CLIENT_*``)."""

    def __init__(
        self,
        code: str,
        message: str,
        status: Optional[int] = None,
        run_id: Optional[str] = None,
        retry_after: Optional[float] = None,
        details: Optional[dict] = None,
    ):
        super().__init__("%s: %s" % (code, message))
        self.code = code
        self.message = message
        self.status = status
        self.run_id = run_id
        #: Seconds to wait before trying again, when Ferry said (``Retry-After``).
        self.retry_after = retry_after
        #: The other members of Ferry's ``error`` object (``type`` of a function's exception, ...).
        self.details = details or {}


class AuthError(FerryError):
    """401 or 403: the token is missing, wrong, expired, or lacks the scope."""


class NotFoundError(FerryError):
    """404: no such project, app, function or run."""


class InvalidRequestError(FerryError):
    """Another 4xx: the request itself is wrong (bad JSON, a bad webhook URL, ...)."""


class UnavailableError(FerryError):
    """429 or 503: try again later (``retry_after`` says when, if Ferry said)."""


class RunFailedError(FerryError):
    """The run ran and did not succeed: the function raised, timed out, or was cancelled."""


class FerryConnectionError(FerryError):
    """Ferry could not be reached, or the connection broke (code ``FERRY_CLIENT_CONNECTION``)."""


def error_for(status: int, body: object, run_id: Optional[str], retry_after: Optional[float]) -> FerryError:
    """The exception for an error answer: its class by status, its code and message from the body."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("code"), str):
        code = error["code"]
        message = str(error.get("message", ""))
        details = {k: v for k, v in error.items() if k not in ("code", "message")}
    else:
        code = "FERRY_CLIENT_UNEXPECTED_ANSWER"
        message = "HTTP %d without a Ferry error body" % status
        details = {}
    if isinstance(body, dict) and isinstance(body.get("run_id"), str):
        run_id = body["run_id"]
    if status in (401, 403):
        cls = AuthError
    elif status == 404:
        cls = NotFoundError
    elif status in (429, 503):
        cls = UnavailableError
    elif 400 <= status < 500:
        cls = InvalidRequestError
    elif code in ("FERRY_FUNCTION_ERROR", "FERRY_RUN_TIMEOUT") or status == 504:
        cls = RunFailedError
    else:
        cls = FerryError
    return cls(code, message, status=status, run_id=run_id, retry_after=retry_after, details=details)
