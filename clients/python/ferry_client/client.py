"""The client: ``Ferry`` (where the server is, the token, the project), ``App`` (calls of one app's
functions: ``call``, ``spawn``, ``stream``) and ``Run`` (a spawned run: ``result``, ``cancel``, ``logs``).
HTTP through the standard library's ``http.client``; nothing else is needed."""

import http.client
import json
import os
import time
import urllib.parse
from typing import Any, Dict, Iterator, List, Optional

from .errors import FerryConnectionError, FerryError, RunFailedError, error_for

#: A run's states that are final.
FINAL_STATES = ("success", "failure", "timeout", "cancelled")


class Ferry:
    """A Ferry server and a project on it. Each argument not given is read from the environment:
    ``FERRY_URL``, ``FERRY_TOKEN``, ``FERRY_PROJECT`` (what ``ferry admin bootstrap`` prints)."""

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        project: Optional[str] = None,
        timeout: float = 60.0,
    ):
        url = url or os.environ.get("FERRY_URL")
        project = project or os.environ.get("FERRY_PROJECT")
        if not url:
            raise ValueError("Ferry(url=...) or FERRY_URL is required (the server's address)")
        if not project:
            raise ValueError("Ferry(project=...) or FERRY_PROJECT is required (a project id)")
        self.url = url.rstrip("/")
        self.token = token if token is not None else os.environ.get("FERRY_TOKEN")
        self.project = project
        #: Seconds a request may take to connect and between bytes (not a whole sync call's limit).
        self.timeout = timeout
        self._run_url: Optional[str] = None

    def app(self, name: str) -> "App":
        """The app ``name`` of the project."""
        return App(self, name)

    @property
    def run_url(self) -> str:
        """Where apps are called: the project's ``run_url`` when the server serves runs apart from its
        API (``FERRY_RUN_PORT``), else the server's own address."""
        if self._run_url is None:
            try:
                project = self._json("GET", "%s/v2/projects/%s" % (self.url, _q(self.project)))
                self._run_url = (project.get("run_url") or self.url).rstrip("/")
            except FerryError as err:
                # A token with the run scope only may not read the project: runs are then at the API's address.
                if err.status in (401, 403):
                    self._run_url = self.url
                else:
                    raise
        return self._run_url

    # -- HTTP ---------------------------------------------------------------------------------------

    def _open(
        self,
        method: str,
        url: str,
        body: Optional[bytes] = None,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> http.client.HTTPResponse:
        parts = urllib.parse.urlsplit(url)
        conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(parts.netloc, timeout=self.timeout if timeout is None else timeout)
        all_headers = {"User-Agent": "ferry-client-python/0.1.0"}
        if self.token:
            all_headers["Authorization"] = "Bearer " + self.token
        if body is not None:
            all_headers["Content-Type"] = "application/json"
        all_headers.update(headers or {})
        target = parts.path + ("?" + parts.query if parts.query else "")
        try:
            conn.request(method, target, body=body, headers=all_headers)
            return conn.getresponse()
        except (OSError, http.client.HTTPException) as err:
            conn.close()
            raise FerryConnectionError("FERRY_CLIENT_CONNECTION", "%s %s: %s" % (method, url, err)) from err

    def _json(self, method: str, url: str, body: Any = None, headers: Optional[Dict[str, str]] = None,
              timeout: Optional[float] = None) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        res = self._open(method, url, data, headers, timeout)
        try:
            raw = res.read()
        except (OSError, http.client.HTTPException) as err:
            raise FerryConnectionError("FERRY_CLIENT_CONNECTION", "%s %s: %s" % (method, url, err)) from err
        finally:
            res.close()
        return _answer(res, raw)

    def _api(self, path: str) -> str:
        return "%s/v2/projects/%s%s" % (self.url, _q(self.project), path)


class App:
    """One app of the project: its functions are called by name."""

    def __init__(self, ferry: Ferry, name: str):
        self.ferry = ferry
        self.name = name

    def _run_endpoint(self, function: str, query: Optional[Dict[str, str]] = None) -> str:
        url = "%s/v4/%s/%s/%s" % (self.ferry.run_url, _q(self.ferry.project), _q(self.name), _q(function))
        return url + ("?" + urllib.parse.urlencode(query) if query else "")

    def call(self, function: str, input: Optional[Dict[str, Any]] = None, timeout: Optional[float] = None) -> Any:
        """Calls ``function`` with ``input`` (its arguments, a dict) and returns its result. Raises the
        error Ferry answered (``RunFailedError`` when the function raised: ``details['type']`` is the
        exception's type)."""
        answer = self.ferry._json("POST", self._run_endpoint(function), input or {}, timeout=timeout)
        return answer.get("result") if isinstance(answer, dict) else answer

    def spawn(
        self,
        function: str,
        input: Optional[Dict[str, Any]] = None,
        webhook: Optional[str] = None,
        webhook_secret: Optional[str] = None,
        idempotency_key: Optional[str] = None,
    ) -> "Run":
        """Starts ``function`` without waiting (``?async=true``) and returns its run. With ``webhook``,
        Ferry posts the result there, signed with ``webhook_secret`` when given. A repeat with the same
        ``idempotency_key`` within 24 hours returns the first call's run."""
        query = {"async": "true"}
        if webhook:
            query["webhookEndpoint"] = webhook
        headers = {}
        if webhook_secret:
            headers["X-Webhook-Secret"] = webhook_secret
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        answer = self.ferry._json("POST", self._run_endpoint(function, query), input or {}, headers)
        return Run(self, answer["run_id"])

    def run(self, run_id: str) -> "Run":
        """A run of this app by its id (from ``spawn``, a webhook or the dashboard)."""
        return Run(self, run_id)

    def stream(
        self,
        function: str,
        input: Optional[Dict[str, Any]] = None,
        decode: bool = True,
        reconnects: int = 5,
    ) -> Iterator[Any]:
        """Calls a generator function and yields each item as it comes. An item sent as JSON is decoded
        (``decode=False`` yields each item's text as sent; a string item is sent as it is, so a string that
        reads as JSON comes decoded). A broken connection is resumed where it broke (``Last-Event-ID``: the
        run goes on, nothing is run twice), up to ``reconnects`` times in a row. Raises the run's error
        after the items it sent."""
        url = self._run_endpoint(function)
        body = json.dumps(input or {}).encode("utf-8")
        last_id: Optional[str] = None
        failures = 0
        retry_ms = 1000
        while True:
            headers = {"Accept": "text/event-stream"}
            if last_id is not None:
                headers["Last-Event-ID"] = last_id
            try:
                res = self.ferry._open("POST", url, body, headers)
            except FerryConnectionError:
                if last_id is None or failures >= reconnects:
                    raise
                failures += 1
                time.sleep(retry_ms / 1000)
                continue
            if res.status == 204:  # resumed after the last item: the run is over
                res.close()
                return
            if res.status != 200:
                raw = res.read()
                res.close()
                _answer(res, raw)  # raises
                return
            ended = False
            error: Optional[FerryError] = None
            try:
                for kind, value in _events(res):
                    if kind == "retry":
                        retry_ms = value
                    elif kind == "item":
                        item_id, data = value
                        if item_id is not None:
                            last_id = item_id
                        failures = 0
                        yield _decode(data) if decode else data
                    elif kind == "error":
                        error = error_for(500, value, value.get("run_id") if isinstance(value, dict) else None, None)
                        if error.code == "FERRY_STREAM_EVENTS_DROPPED":
                            error = None  # said on a resume: the stream goes on from the oldest kept event
                    elif kind == "end":
                        ended = True
                        state = value.get("state") if isinstance(value, dict) else None
                        if error is None and state != "success":
                            error = RunFailedError(
                                "FERRY_CLIENT_RUN_%s" % str(state).upper(),
                                "the run ended %s" % state,
                                run_id=value.get("run_id"),
                            )
                        break
            except (OSError, http.client.HTTPException):
                pass  # a broken connection: resumed below
            finally:
                res.close()
            if ended:
                if error is not None:
                    raise (error if isinstance(error, RunFailedError) else _as_run_failed(error))
                return
            if last_id is None or failures >= reconnects:
                raise FerryConnectionError(
                    "FERRY_CLIENT_CONNECTION", "the stream broke before it ended and could not be resumed"
                )
            failures += 1
            time.sleep(retry_ms / 1000)


class Run:
    """A run started by ``App.spawn`` (or found by its id)."""

    def __init__(self, app: App, run_id: str):
        self.app = app
        self.id = run_id

    def __repr__(self) -> str:
        return "Run(%r, app=%r)" % (self.id, self.app.name)

    def _path(self, rest: str = "") -> str:
        return self.app.ferry._api("/apps/%s/runs/%s%s" % (_q(self.app.name), _q(self.id), rest))

    def status(self, wait: int = 0) -> Dict[str, Any]:
        """The run's record (``state``, ``result``, ``error``, timestamps, ``attempts``, ...); with ``wait``
        (0 to 60 seconds) Ferry answers as soon as the run has ended, or after ``wait`` seconds."""
        query = "?wait=%d" % wait if wait else ""
        return self.app.ferry._json("GET", self._path(query), timeout=self.app.ferry.timeout + wait)

    def result(self, timeout: Optional[float] = None) -> Any:
        """Waits for the run to end and returns its result; raises ``RunFailedError`` when it did not
        succeed, and ``FerryError('FERRY_CLIENT_TIMEOUT')`` after ``timeout`` seconds (None: no limit).
        A result over the server's stored bound (256 KiB by default) is not kept: ``None`` then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = 60 if deadline is None else max(0, min(60, int(deadline - time.monotonic())))
            record = self.status(wait=remaining)
            state = record.get("state")
            if state == "success":
                return record.get("result")
            if state in FINAL_STATES:
                error = record.get("error") or {}
                raise RunFailedError(
                    error.get("code") or "FERRY_CLIENT_RUN_%s" % str(state).upper(),
                    error.get("message") or "the run ended %s" % state,
                    run_id=self.id,
                    details={k: v for k, v in error.items() if k not in ("code", "message")},
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise FerryError(
                    "FERRY_CLIENT_TIMEOUT", "the run is still %s after %s s" % (state, timeout), run_id=self.id
                )

    def cancel(self) -> Dict[str, Any]:
        """Cancels the run (queued or running); returns its record. Raises ``FERRY_RUN_FINISHED`` (409)
        when it had already finished."""
        return self.app.ferry._json("POST", self._path("/cancel"), {})

    def logs(self) -> List[Dict[str, Any]]:
        """What the function printed during the run: ``[{"seq", "at", "stream", "line"}]``."""
        lines: List[Dict[str, Any]] = []
        after = None
        for _page in range(1000):  # bounded: a run keeps at most 10,000 lines
            query = "?after=%d" % after if after is not None else ""
            page = self.app.ferry._json("GET", self._path("/logs" + query))
            batch = page.get("lines") or []
            lines.extend(batch)
            if not batch:
                break
            after = batch[-1]["seq"]
        return lines


def _q(text: str) -> str:
    return urllib.parse.quote(text, safe="")


def _answer(res: http.client.HTTPResponse, raw: bytes) -> Any:
    try:
        body = json.loads(raw.decode("utf-8")) if raw else None
    except ValueError:
        body = None
    if 200 <= res.status < 300:
        return body
    retry = res.getheader("Retry-After")
    retry_after = float(retry) if retry and retry.replace(".", "", 1).isdigit() else None
    raise error_for(res.status, body, res.getheader("X-Request-Id"), retry_after)


def _as_run_failed(error: FerryError) -> RunFailedError:
    return RunFailedError(error.code, error.message, run_id=error.run_id, details=error.details)


def _decode(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data


def _events(res: http.client.HTTPResponse) -> Iterator[Any]:
    """Server-sent events: ("retry", ms), ("item", (id, data)), ("error", obj) and ("end", obj) from the
    comments Ferry ends a stream with (docs/api.md, streaming mode)."""
    data: List[str] = []
    event_id: Optional[str] = None
    while True:
        raw = res.readline()
        if not raw:
            return
        line = raw.decode("utf-8").rstrip("\r\n")
        if line == "":
            if data:
                yield ("item", (event_id, "\n".join(data)))
            data, event_id = [], None
            continue
        if line.startswith(":"):
            comment = line[1:].lstrip()
            for name in ("error", "end"):
                if comment.startswith(name + " "):
                    try:
                        yield (name, json.loads(comment[len(name) + 1:]))
                    except ValueError:
                        pass
            continue
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            data.append(value)
        elif field == "id":
            event_id = value
        elif field == "retry" and value.isdigit():
            yield ("retry", int(value))
