"""The one catalogue of transient conditions, and the detectors that use it agree."""

from __future__ import annotations

import errno
import socket

import pytest

from trainer import failure_catalogue as catalogue
from trainer.failure_catalogue import http_status_kind, judge_exception_text, transient_exception


def _raise(exc: BaseException) -> BaseException:
    """`exc` raised here, by a `raise` statement in test (user) code."""
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001
        return caught


def _from_socket() -> BaseException:
    """A TimeoutError raised by the socket module (C code), not by a `raise` statement here."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    client.settimeout(0.01)
    try:
        client.recv(1)
    except TimeoutError as exc:
        return exc
    finally:
        client.close()
        server.close()
    raise AssertionError("recv did not time out")


@pytest.mark.parametrize(
    "status, kind",
    [(500, "infra"), (502, "infra"), (503, "infra"), (504, "infra"), (429, "infra"), (408, "infra"),
     (501, "user"), (505, "user"), (400, "user"), (401, "user"), (403, "user"), (404, "user"), (422, "user"),
     (200, None), (True, None), ("503", None)],
)  # fmt: skip
def test_http_status_classes(status, kind):
    assert http_status_kind(status) == kind


@pytest.mark.parametrize(
    "exc, transient",
    [
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), True),
        (BrokenPipeError(errno.EPIPE, "Broken pipe"), True),
        (OSError(errno.EIO, "Input/output error"), True),
        (OSError(errno.ESTALE, "Stale file handle"), True),
        (socket.gaierror(-3, "Temporary failure in name resolution"), True),
        (socket.gaierror(-2, "Name or service not known"), True),  # a peer's DNS record not there yet
        (OSError(errno.ENOENT, "No such file or directory"), False),
        (PermissionError(errno.EACCES, "Permission denied"), False),
        (ValueError("Connection reset by peer"), False),
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (RuntimeError("Failed to retrieve data from the hub. Server could be down. Please try again later."), True),
    ],
    ids=repr,
)
def test_live_exceptions_by_type_then_message(exc, transient):
    assert (transient_exception(exc) is not None) is transient


def test_a_timeout_the_user_raised_is_not_transient_one_the_socket_raised_is():
    assert transient_exception(_raise(TimeoutError("data loader stalled"))) is None
    assert transient_exception(_raise(ConnectionError("my protocol broke"))) is None
    assert transient_exception(_from_socket()) is not None
    # A RuntimeError the user raised with infra words is still the user's.
    assert transient_exception(_raise(RuntimeError("Connection closed by peer"))) is None
    assert transient_exception(_raise(RuntimeError("no weights yet, try again later"))) is None


def test_causes_are_walked():
    try:
        try:
            raise OSError(errno.ETIMEDOUT, "Connection timed out")
        except OSError as cause:
            raise RuntimeError("could not load the shard") from cause
    except RuntimeError as exc:
        assert "ETIMEDOUT" in transient_exception(exc)


class _ClientError(Exception):
    """Shaped like botocore.exceptions.ClientError."""

    def __init__(self, code: str, status: int = 400):
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
        super().__init__(f"An error occurred ({code}) when calling the GetObject operation")


_ClientError.__name__ = "ClientError"


@pytest.mark.parametrize(
    "code, transient",
    [("SlowDown", True), ("ThrottlingException", True), ("RequestTimeout", True), ("ServiceUnavailable", True),
     ("503", True), ("AccessDenied", False), ("NoSuchKey", False), ("ServerBusy", True), ("rateLimitExceeded", True)],
)  # fmt: skip
def test_cloud_error_codes(code, transient):
    assert (transient_exception(_ClientError(code)) is not None) is transient


@pytest.mark.parametrize(
    "type_name, message, raised_by_user, in_user_frames, kind",
    [
        ("ValueError", "Connection reset by peer", True, True, "user"),
        ("TimeoutError", "stalled", True, True, "user"),
        ("TimeoutError", "timed out", False, True, "infra"),
        ("TimeoutError", "timed out", None, False, "infra"),
        ("ConnectionResetError", "[Errno 104] Connection reset by peer", True, True, "infra"),
        ("OSError", "[Errno 5] Input/output error", False, True, "infra"),
        ("OSError", "[Errno 2] No such file or directory: 'x'", False, True, None),
        ("ValueError", "host not found: Temporary failure in name resolution", False, True, "infra"),
        ("RuntimeError", "503 Server Error: Service Unavailable for url: https://hub/x", False, False, "infra"),
        ("botocore.exceptions.ClientError", "An error occurred (SlowDown) when calling the PutObject operation", None, False, "infra"),  # fmt: skip
        ("RuntimeError", "404 Client Error: Not Found for url: https://hub/x", False, False, None),
        # a server, or a library speaking for it, says the failure is temporary (a RuntimeError's message
        # decides, as a 503's does); a type that says the program is wrong still decides first
        ("RuntimeError", "Could not reach the model server. Please try again later.", False, True, "infra"),
        ("ValueError", "Could not reach the model server. Please try again later.", True, True, "user"),
        ("KeyError", "'weight'", None, True, "user"),
    ],
)
def test_text_judgement(type_name, message, raised_by_user, in_user_frames, kind):
    found = judge_exception_text(type_name, message, raised_by_user=raised_by_user, in_user_frames=in_user_frames)
    assert (found[0] if found else None) == kind, found


# -- the detectors that use it ----------------------------------------------------------------------


def test_trainer_tags_a_user_valueerror_with_infra_words_as_user():
    from trainer.errors import source_of, user_code

    with pytest.raises(ValueError) as info:
        with user_code():
            raise ValueError("bad record: Connection reset by peer")
    assert source_of(info.value) == "user"
    with pytest.raises(ConnectionResetError) as info:
        with user_code():
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
    assert source_of(info.value) is None  # infrastructure: not blamed on the user


def test_dataset_unreachable_uses_the_catalogue():
    from operators.exceptions import StorageUnavailable
    from operators.hooks import dvc as dataset

    class _Odb:
        path = "/remote"

        def __init__(self, probe_error):
            self.fs = type("Fs", (), {"unstrip_protocol": staticmethod(lambda p: p), "info": self._raise})()
            self.probe_error = probe_error

        def _raise(self, path):
            raise self.probe_error

        def oid_to_path(self, oid):
            return f"/remote/{oid}"

    def repo(probe_error):
        cloud = type("Cloud", (), {"get_remote_odb": lambda self, name, op: _Odb(probe_error)})()
        return type("Repo", (), {"cloud": cloud})()

    with pytest.raises(StorageUnavailable, match="unreachable: TimeoutError"):
        dataset._fetch(repo(OSError(errno.ETIMEDOUT, "Connection timed out")), ["0" * 32])
    with pytest.raises(PermissionError):  # the caller's mistake: not retried as "unreachable"
        dataset._fetch(repo(PermissionError(errno.EACCES, "Permission denied")), ["0" * 32])


def test_retry_policy_and_tracking_agree_with_the_catalogue():
    from operators.exceptions import RegistryUnavailable
    from operators.hooks import mlflow as tracking
    from operators.retry import judge_exception

    def unavailable(exc):
        try:
            with tracking.mlflow_errors("http://mlflow:5000", "test"):
                raise exc
        except RegistryUnavailable:
            return True
        except Exception:  # noqa: BLE001 - passed through unchanged
            return False

    for exc in (OSError(errno.EIO, "Input/output error"), _ClientError("SlowDown"), ConnectionResetError()):
        assert judge_exception(exc)[0] == "infra"
        assert unavailable(exc)
    for exc in (ValueError("Connection reset by peer"), _ClientError("AccessDenied")):
        assert judge_exception(exc)[0] is None
        assert not unavailable(exc)


def test_kubernetes_client_status_classes():
    import asyncio

    from operators.exceptions import KubernetesApiError, KubernetesRequestError
    from operators.hooks.kubernetes import GangApi

    kubernetes_asyncio = pytest.importorskip("kubernetes_asyncio")
    ApiException = kubernetes_asyncio.client.exceptions.ApiException

    class _Api:
        def __init__(self, status):
            self.status = status

        async def call_api(self, *args, **kwargs):
            raise ApiException(status=self.status, reason="x")

    for status, expected in ((503, KubernetesApiError), (429, KubernetesApiError), (501, KubernetesRequestError), (403, KubernetesRequestError)):  # fmt: skip
        client = GangApi(_Api(status), "default")
        with pytest.raises(expected):
            asyncio.run(client._call("get", "JobSet default/x", "GET", "/apis/x"))


def test_one_catalogue():
    assert catalogue.TRANSIENT_MESSAGE.search("ncclRemoteError: remote process exited")
    assert errno.EIO in catalogue.TRANSIENT_ERRNOS and errno.ENOENT not in catalogue.TRANSIENT_ERRNOS


def test_mlflow_server_errors_and_the_tracking_database_are_transient():
    from mlflow.exceptions import MlflowException, RestException
    from sqlalchemy.exc import OperationalError

    assert transient_exception(RestException({"error_code": "INTERNAL_ERROR", "message": "boom"}))
    assert transient_exception(RestException({"error_code": "ABORTED", "message": "conflict"}))
    assert not transient_exception(MlflowException("a local bug"))  # INTERNAL_ERROR is only the default code
    assert not transient_exception(RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no run"}))
    assert transient_exception(OperationalError("SELECT 1", {}, Exception("could not connect to server")))
