"""The one catalogue of transient (infrastructure) conditions: everything in gangflow that asks "is
this failure worth another try?" asks here, so a condition added here is known everywhere at once.

An exception is judged by its type first (infrastructure-only types; generic ones by who raised
them; "the program is wrong" types), its message second (error codes, HTTP status classes,
NCCL/gloo/CUDA errors). Pure standard library: the trainer and Airflow workers both import it.
"""

from __future__ import annotations

import errno
import re
import sys
from collections.abc import Iterator
from typing import Literal

from trainer.checks import is_integer

__all__ = [
    "INFRA_EXCEPTION_NAMES",
    "TRANSIENT_CLOUD_CODES",
    "TRANSIENT_ERRNOS",
    "USER_EXCEPTION_NAMES",
    "causes",
    "http_status_kind",
    "judge_exception_text",
    "transient_errno",
    "transient_exception",
    "transient_message",
    "TRANSIENT_MESSAGE",
    "GPU_HARDWARE",
    "COLLECTIVE_TIMEOUT",
    "PEER_LOST",
    "RENDEZVOUS",
    "STORAGE",
    "NETWORK",
    "HTTP_TRANSIENT",
    "RETRY_LATER",
    "is_library_path",
]

Judgement = tuple[Literal["infra", "user"], str]

# errno values that mean "the machine, the network or the storage failed", not "you asked for
# something that does not exist" (ENOENT, EACCES, EISDIR... are the caller's mistake).
TRANSIENT_ERRNOS: frozenset[int] = frozenset(
    getattr(errno, name)
    for name in (
        "EIO", "ESTALE", "ETIMEDOUT", "ECONNRESET", "ECONNABORTED", "ECONNREFUSED", "EPIPE",
        "ENETUNREACH", "ENETDOWN", "ENETRESET", "EHOSTUNREACH", "EHOSTDOWN", "EREMOTEIO", "ENOLINK",
        "ECOMM", "EPROTO", "EAGAIN",
    )
    if hasattr(errno, name)
)  # fmt: skip
# getaddrinfo's EAI_AGAIN ("Temporary failure in name resolution") is transient by definition;
# EAI_NONAME ("Name or service not known") too in practice: on Kubernetes a peer's DNS record
# appears only once its pod runs, and resolvers fail intermittently (corpus train cases).
EAI_AGAIN = -3
EAI_NONAME = -2

# Exception class names that only infrastructure raises: infra wherever they were raised.
INFRA_EXCEPTION_NAMES: frozenset[str] = frozenset({
    # Python built-ins (OSError subclasses with a transient meaning)
    "ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError", "ConnectionRefusedError",
    "IncompleteRead", "RemoteDisconnected",
    # torch.distributed / TorchElastic
    "DistNetworkError", "DistStoreError", "RendezvousTimeoutError", "RendezvousClosedError",
    "RendezvousConnectionError", "RendezvousStateError",
    # urllib3 / requests / httpx / aiohttp
    "NewConnectionError", "MaxRetryError", "ProtocolError", "ConnectTimeoutError", "ReadTimeoutError",
    "ConnectTimeout", "ReadTimeout", "ConnectError", "RemoteProtocolError", "ServerDisconnectedError",
    "ClientConnectorError", "ClientConnectionError", "ClientOSError", "ServerTimeoutError",
    "ProxyConnectionError", "ChunkedEncodingError",
    # botocore / s3fs / gcsfs / google-api-core / azure-core
    "EndpointConnectionError", "ConnectionClosedError", "ServiceUnavailable", "TooManyRequests",
    "InternalServerError", "BadGateway", "GatewayTimeout", "ServiceResponseError",
    "ServiceRequestError", "RetryError", "TransportError",
    # Ray
    "NodeDiedError", "RayActorError", "ActorDiedError", "ObjectLostError", "OwnerDiedError",
    "WorkerCrashedError", "RaySystemError", "GetTimeoutError", "ActorUnavailableError",
    "NodeAffinitySchedulingStrategyError", "RayChannelTimeoutError",
    # TensorFlow's status types for a peer or service that went away (errors_impl)
    "UnavailableError", "AbortedError",
})  # fmt: skip
# Generic types a program often raises itself: the user's when user code raised them.
AMBIGUOUS_EXCEPTION_NAMES: frozenset[str] = frozenset({
    "TimeoutError", "timeout", "ConnectionError", "OSError", "IOError", "EnvironmentError", "gaierror",
    "DistBackendError", "DistError", "ChildFailedError",
})  # fmt: skip
# Types that say "the program, its config or its data is wrong" when user code raised them.
USER_EXCEPTION_NAMES: frozenset[str] = frozenset({
    "ValueError", "TypeError", "KeyError", "IndexError", "AttributeError", "NameError",
    "UnboundLocalError", "AssertionError", "ZeroDivisionError", "NotImplementedError",
    "ImportError", "ModuleNotFoundError", "SyntaxError", "IndentationError", "TabError",
    "FileNotFoundError", "IsADirectoryError", "NotADirectoryError", "PermissionError",
    "FileExistsError", "RecursionError", "OverflowError", "LookupError", "UnicodeDecodeError",
    "UnicodeEncodeError", "JSONDecodeError", "UnpicklingError", "StopIteration", "ArithmeticError",
    "FloatingPointError", "ConfigError", "HFValidationError",
    # TensorFlow's status types for a wrong program, input or file (errors_impl)
    "InvalidArgumentError", "OutOfRangeError", "UnimplementedError", "FailedPreconditionError",
    # botocore: the client has no usable credentials or region (its configuration)
    "NoCredentialsError", "PartialCredentialsError", "NoRegionError", "ProfileNotFound",
})  # fmt: skip

# Cloud storage / API error codes that mean "throttled or briefly unavailable": botocore
# (S3, STS, DynamoDB), Google Cloud Storage JSON API reasons, Azure Storage error codes.
TRANSIENT_CLOUD_CODES: frozenset[str] = frozenset({
    # AWS
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequestsException", "ProvisionedThroughputExceededException",
    "RequestLimitExceeded", "RequestTimeout", "RequestTimeoutException", "ServiceUnavailable",
    "InternalError", "InternalFailure", "BandwidthLimitExceeded", "EC2ThrottledException",
    "PriorRequestNotComplete", "TransactionInProgressException", "IDPCommunicationError",
    # Google Cloud Storage / API
    "rateLimitExceeded", "userRateLimitExceeded", "backendError", "internalError",
    "UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "ABORTED", "INTERNAL",
    # Azure Storage
    "ServerBusy", "OperationTimedOut", "InternalError", "ServiceUnavailable",
    # MLflow REST error codes
    "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED",
})  # fmt: skip

# The HTTP statuses worth a retry: 408, 429 and the 5xx class except 501/505 (the server will
# never support that request).
_NOT_TRANSIENT_5XX = {501, 505}


def http_status_kind(status: object) -> Literal["infra", "user"] | None:
    """'infra' for a transient HTTP status (5xx but 501/505, 429, 408), 'user' for other 4xx."""
    if isinstance(status, bool) or not isinstance(status, int):
        return None
    if status in (408, 429) or (500 <= status < 600 and status not in _NOT_TRANSIENT_5XX):
        return "infra"
    if 400 <= status < 500 or status in _NOT_TRANSIENT_5XX:
        return "user"
    return None


def transient_errno(number: object) -> str | None:
    """The errno's name when it is a transient one, else None."""
    if isinstance(number, bool) or not isinstance(number, int):
        return None
    if number in TRANSIENT_ERRNOS:
        return errno.errorcode.get(number, str(number))
    if number == EAI_AGAIN:
        return "EAI_AGAIN"
    if number == EAI_NONAME:
        return "EAI_NONAME"
    return None


# -- messages ------------------------------------------------------------------------------------


def _rx(*patterns: str) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)


_TRANSIENT_ERRNO_NAMES = "|".join(sorted(errno.errorcode[n] for n in TRANSIENT_ERRNOS if n in errno.errorcode))

# Messages naming a transient condition, by family (the classifier's rules are named after
# them). Each pattern names a condition (an errno, a status class, an error code), never one
# tracker's wording.
GPU_HARDWARE = _rx(
    r"uncorrectable ECC error", r"ECC_UNCORRECTABLE", r"\bdouble[- ]bit ECC", r"fallen off the bus",
    r"CUDA error: unspecified launch failure", r"CUDA error: (?:an )?uncorrectable NVLink error",
    r"GPU (?:is lost|has fallen)", r"CUDA-capable device\(s\) is/are busy or unavailable",
    r"cudaErrorDevicesUnavailable", r"CUDA_ERROR_ECC_UNCORRECTABLE", r"the launch timed out and was terminated",
    r"over nvlink or a hardware error",
)  # fmt: skip
COLLECTIVE_TIMEOUT = _rx(
    r"Watchdog caught collective operation timeout", r"NCCL watchdog[^\n]*time(?:d )?out",
    r"ProcessGroupNCCL[^\n]*time(?:d )?out", r"ProcessGroupGloo[^\n]*Timed out", r"gloo[^\n]*Timed out waiting",
    r"Some NCCL operations have failed or timed out", r"NCCL communicator was aborted",
)  # fmt: skip
PEER_LOST = _rx(
    r"Connection closed by (?:remote )?peer", r"Connection reset by peer", r"ncclRemoteError",
    r"remote process exited or there was a network error", r"Got completion from peer [^\n]* with (?:error|status)",
    r"NET/IB[^\n]*error", r"Broken pipe",
    # UCX/verbs: the peer's queue pair stopped acknowledging (a peer died or the fabric failed)
    r"Transport retry count exceeded",
)  # fmt: skip
RENDEZVOUS = _rx(
    r"RendezvousTimeoutError", r"RendezvousClosedError", r"RendezvousConnectionError",
    r"The client socket has timed out after \d+", r"connect\(\) timed out\. Original timeout",
    # a Ray node that could not join its cluster (`ray start` under KubeRay): the raylet did not
    # register with the head's GCS in time, or the head's GCS never answered
    r"The current node timed out during startup", r"No node info found for head node in GCS",
)  # fmt: skip
STORAGE = _rx(
    r"Stale (?:NFS )?file handle", r"\[Errno 116\]", r"Input/output error", r"\[Errno 5\]", r"\bEIO\b",
    r"\bESTALE\b", r"\bEREMOTEIO\b",
    # cloud storage throttling / availability codes, as botocore, gcsfs and azure print them
    r"An error occurred \((?:SlowDown|Throttling\w*|RequestTimeout\w*|ServiceUnavailable|InternalError|RequestLimitExceeded|ProvisionedThroughputExceeded\w*|InternalFailure|TooManyRequests\w*|BandwidthLimitExceeded)\)",
    r"\bSlowDown\b", r"Please reduce your request rate", r"\bServerBusy\b", r"\bOperationTimedOut\b",
    r"\b(?:rateLimitExceeded|backendError)\b", r"\bRequestTimeout\b", r"\bServiceUnavailable\b",
    r"\bSLOW_DOWN\b", r"\bTHROTTLING\b", r"\bSERVICE_UNAVAILABLE\b",  # the AWS C++ SDK's (Arrow, Ray) spelling
    r"\bRequestLimitExceeded\b",  # EC2's API throttling code, as clients log it outside botocore's sentence
)  # fmt: skip
NETWORK = _rx(
    r"Temporary failure in name resolution", r"\bEAI_AGAIN\b", r"Name or service not known", r"\bEAI_NONAME\b",
    r"nodename nor servname provided", r"\bConnectionError\b",
    r"ConnectionRefusedError", r"ConnectionResetError", r"ConnectionAbortedError", r"NewConnectionError",
    r"Max retries exceeded with url", r"RemoteDisconnected", r"Remote end closed connection", r"Connection timed out",
    r"\bETIMEDOUT\b", r"\bECONNRESET\b", r"\bECONNREFUSED\b", r"Network is (?:unreachable|down)", r"No route to host",
    r"\b(?:TimeoutError|BrokenPipeError|DistNetworkError|EndpointConnectionError|ReadTimeout|ConnectTimeout)\b",
    r"Could not connect to the endpoint URL", r"Read timed out", r"Failed to establish a new connection",
    r"\[Errno (?:101|103|104|110|111|113)\]", r"TLS handshake timeout", r"\bi/o timeout\b",
    r"EOF occurred in violation of protocol", r"failed to connect to all addresses", r"\bStatusCode\.UNAVAILABLE\b",
    r"server closed the connection unexpectedly", r"database is locked", r"Host is down", r"\bEHOSTDOWN\b",
    r"connect(?:ion)?: connection refused", r"Connection refused", r"unreachable backend", r"Read timeout on endpoint URL",
    r"Connect timeout on endpoint URL", r"Connection broken: IncompleteRead", r"Timeout was reached", r"\bNETWORK_CONNECTION\b",
    r"(?:read|write|connect) operation timed out", r"Connection aborted", r"Software caused connection abort",
    r"\bECONNABORTED\b", r"no route to host", r"TLS handshake timeout", r"\bdial tcp [^\n]{0,80}(?:timeout|refused|reset)",
    r"\bConnectTimeoutError\b", r"\(connect timeout=[\d.]+\)",
    r"Socket timed out on send/recv operation",  # Slurm's controller did not answer (overloaded): not the request's fault
    # curl's connect failure, partial file, timeout, empty reply and receive failure, as curl prints them
    # or as Python's subprocess reports curl's exit status
    r"\bcurl: \((?:7|18|28|52|56)\)", r"Server returned nothing \(no headers, no data\)", r"Command '\s*curl\b[^'\n]{0,2000}' returned non-zero exit status (?:7|18|28|52|56)\b",
)  # fmt: skip
# A download quota that clears by itself: Google Drive's per-file limit (gdown prints it under "Access denied").
DOWNLOAD_QUOTA = _rx(
    r"Too many users have viewed or downloaded this file recently", r"The download quota for this file has been exceeded",
)  # fmt: skip
# HTTP status classes: 5xx (but 501/505), 429 and 408 are transient; said by a remote service.
HTTP_TRANSIENT = _rx(
    r"\b(?:HTTP(?:/\d(?:\.\d)?)?(?: Error)?|[Ss]tatus(?: [Cc]ode)?|response code|error code|returned)[ :=]*(?:429|408|50[02346789]|5[1-9]\d)\b",
    r"\b(?:50[02346789]|5[1-9]\d) (?:Server Error|Internal Server Error|Bad Gateway|Service Unavailable|Gateway Time-?out)",
    r"\bError (?:50[02346789]|5[1-9]\d): ",  # Google's API clients ("googleapi: Error 503: Backend Error")
    # google-api-core's exceptions ("google.api_core.exceptions.InternalServerError: 500 Job failed ...")
    r"\b(?:InternalServerError|BadGateway|ServiceUnavailable|GatewayTimeout|TooManyRequests):? (?:429|50[02346789]|5[1-9]\d)\b",
    # google-cloud's clients without the exception's name: "503 GET https://bigquery.googleapis.com/..."
    r"\b(?:429|408|50[02346789]|5[1-9]\d) (?:GET|POST|PUT|PATCH|DELETE|HEAD) https?://",
    r"\b(?:Internal Server Error|Bad Gateway|Service Unavailable|Service Temporarily Unavailable|Gateway Time-?out|Too Many Requests)\b",
    r"\b(?:TEMPORARILY_UNAVAILABLE|REQUEST_LIMIT_EXCEEDED|RESOURCE_EXHAUSTED)\b",
    # requests' repr of a response, clients' "<status> response ...", a registry's 429 code
    r"<Response \[(?:429|408|50[02346789]|5[1-9]\d)\]>", r"\b(?:429|50[02346789]) (?:response|encountered)\b",
    r"\btoomanyrequests\b",
    # a 403 that says it is throttling (GitHub's API, GCS's rateLimitExceeded) is a 429 in disguise
    r"\b403\b[^\n]{0,60}\b(?:rate ?limit|rateLimitExceeded)",
    DOWNLOAD_QUOTA.pattern,
)  # fmt: skip
# A service, or the library speaking for it, saying the failure is temporary.
RETRY_LATER = _rx(r"\btry again later\b", r"\bYou can retry your request\b")
# Every family together: a message matching it names a transient condition.
TRANSIENT_MESSAGE = re.compile(
    "|".join(f"(?:{p.pattern})" for p in (GPU_HARDWARE, COLLECTIVE_TIMEOUT, PEER_LOST, RENDEZVOUS, STORAGE, NETWORK, HTTP_TRANSIENT, RETRY_LATER)),
    re.IGNORECASE,
)
# Messages that name a request the user got wrong (a 4xx, a bad code or credentials).
USER_REQUEST_MESSAGE = _rx(
    r"\b(?:HTTP(?:/\d(?:\.\d)?)?(?: Error)?|[Ss]tatus(?: [Cc]ode)?|response code|error code|returned)[ :=]*(?:40[0-7]|409|41\d|42[0-8])\b",
    r"\b(?:401 Client Error|403 Client Error|404 Client Error|Unauthorized|Forbidden)\b", r"\(error 40[0-7]\)",
    r"An error occurred \((?:AccessDenied|NoSuchBucket|NoSuchKey|InvalidAccessKeyId|SignatureDoesNotMatch|403|404|ExpiredToken|InvalidToken)\)",
    r"\b(?:RepositoryNotFoundError|GatedRepoError|EntryNotFoundError|RevisionNotFoundError)\b",
)


def transient_message(text: str) -> str | None:
    """The words of `text` naming a transient condition, or None."""
    match = TRANSIENT_MESSAGE.search(text or "")
    return match.group(0) if match else None


_ERRNO_IN_MESSAGE = re.compile(r"\[Errno (-?\d+)\]")


def judge_exception_text(
    type_name: str, message: str, *, raised_by_user: bool | None, in_user_frames: bool
) -> Judgement | None:
    """Judge an exception as printed (type name and message) by its type first, message second.

    `raised_by_user`: its innermost frame is user code running a `raise`/`assert` statement
    (None: no traceback to tell); `in_user_frames`: its traceback passes through user code.
    Returns ("infra"|"user", why) or None when neither its type nor its message decides.
    """
    name = (type_name or "").rsplit(".", 1)[-1]
    message = message or ""
    if name in INFRA_EXCEPTION_NAMES:
        return "infra", f"{name} (an infrastructure error type)"
    errno_match = _ERRNO_IN_MESSAGE.search(message)
    if name in AMBIGUOUS_EXCEPTION_NAMES:
        if raised_by_user:
            return "user", f"{name} raised by user code"
        if errno_match and name not in ("TimeoutError", "timeout"):
            number = int(errno_match.group(1))
            why = transient_errno(number)
            if why:
                return "infra", f"{name} errno {why}"
        if name in ("TimeoutError", "timeout", "ConnectionError"):
            return "infra", f"{name} (a connection or timeout error)"
    elif name in USER_EXCEPTION_NAMES and (raised_by_user or (raised_by_user is None and in_user_frames)):
        return "user", f"{name} raised by user code"
    if errno_match and (name.endswith("Error") or name == "OSError"):
        why = transient_errno(int(errno_match.group(1)))
        if why:
            return "infra", f"{name} errno {why}"
    words = transient_message(message)
    if words:
        return "infra", f"{name}: {words}"
    return None


# -- live exceptions -------------------------------------------------------------------------------


def causes(exc: BaseException, depth: int | None = 8) -> Iterator[BaseException]:
    """`exc`, then what it was raised from or during (`__cause__`, else `__context__`), and so on:
    at most `depth` links (None: all), each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and (depth is None or len(seen) < depth):
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _mro_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _status(exc: BaseException) -> int | None:
    for attr in ("status_code", "status", "code", "http_status"):
        value = getattr(exc, attr, None)
        if is_integer(value) and 100 <= value < 600:
            return value
    response = getattr(exc, "response", None)
    value = getattr(response, "status_code", None) if response is not None else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(response, dict):  # botocore: response["ResponseMetadata"]["HTTPStatusCode"]
        meta = response.get("ResponseMetadata")
        value = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
        return value if isinstance(value, int) else None
    return None


def _raised_by_user_code(exc: BaseException) -> bool:
    """The innermost frame is outside the standard library and site-packages and runs `raise`."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    if is_library_path(filename):
        return False
    import linecache

    line = linecache.getline(filename, tb.tb_lineno).strip()
    return line.startswith(("raise", "assert"))


def _transient_one(exc: BaseException) -> str | None:
    names = _mro_names(exc)
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if name == "OperationalError" and "database is locked" in str(exc):
        return "database is locked"
    if name == "OperationalError" and module.startswith("sqlalchemy"):
        return f"{name} (the tracking database could not be reached or was busy)"
    if type(exc) in (TimeoutError, ConnectionError) and exc.errno is None:
        # The bare built-ins: a program raises these itself too.
        return None if _raised_by_user_code(exc) else f"{name} (a connection or timeout error)"
    if isinstance(exc, ConnectionError):
        return f"{name} (a connection error)"
    if isinstance(exc, OSError) and exc.errno is not None:
        why = transient_errno(exc.errno)
        if why in ("EAI_AGAIN", "EAI_NONAME") and name != "gaierror":
            why = None
        if why:
            return f"{name} errno {why}"
    # botocore ClientError: the service's error code, then its HTTP status.
    response = getattr(exc, "response", None)
    if "ClientError" in names and isinstance(response, dict):
        error = response.get("Error")
        code = str(error.get("Code", "")) if isinstance(error, dict) else ""
        if code in TRANSIENT_CLOUD_CODES or http_status_kind(_int_or_none(code)) == "infra":
            return f"cloud error code {code} (throttled or unavailable)"
        return None
    error_code = getattr(exc, "error_code", None)  # MLflow RestException, Azure HttpResponseError
    if isinstance(error_code, str) and error_code in TRANSIENT_CLOUD_CODES:
        return f"{name} error code {error_code}"
    if "RestException" in names and error_code in _MLFLOW_SERVER_ERROR_CODES:
        # Sent by an MLflow server (HTTP 500); raised locally the code means nothing (the default).
        return f"{name} error code {error_code} (MLflow server error)"
    status = _status(exc)
    if status is not None and ("HTTPError" in names or "ApiException" in names or "HttpError" in names
                               or "HttpResponseError" in names or "ClientResponseError" in names or "GoogleAPICallError" in names):  # fmt: skip
        return f"HTTP {status}" if http_status_kind(status) == "infra" else None
    if "MlflowException" in names:
        # The REST client's wording once its own retries are spent (refused, DNS, 5xx...).
        words = transient_message(str(exc)) or re.search(r"API request to \S+ failed with exception", str(exc))
        return f"MLflow server unavailable ({name})" if words else None
    if names & (INFRA_EXCEPTION_NAMES | _CLIENT_UNREACHABLE) and not module.startswith("builtins"):
        return f"{name} (could not reach a remote service)"
    if name in {"RuntimeError", "DistBackendError", "DistError"} or "torch" in module:
        # torch reports NCCL/gloo/CUDA failures as RuntimeError and friends: the message
        # decides, unless user code raised it.
        words = transient_message(str(exc)[:8192])
        return f"{name}: {words}" if words and not _raised_by_user_code(exc) else None
    return None


_MLFLOW_SERVER_ERROR_CODES = frozenset({"INTERNAL_ERROR", "ABORTED"})

# Client-library classes (requests, httpx...) named like the built-ins: "could not reach it".
_CLIENT_UNREACHABLE = frozenset({"ConnectionError", "Timeout", "TimeoutError", "TimeoutException"})


def _int_or_none(text: str) -> int | None:
    return int(text) if text.isdigit() and len(text) < 4 else None


def transient_exception(exc: BaseException) -> str | None:
    """Why a live exception (or one of its causes) is a transient infrastructure error, or None.

    The type decides; a bare `TimeoutError`/`ConnectionError` raised by user code (a `raise`
    statement outside site-packages and the standard library) is not transient.
    """
    for link in causes(exc):
        why = _transient_one(link)
        if why:
            return why if link is exc else f"{why} (cause of {type(exc).__name__})"
    return None


# -- where code lives --------------------------------------------------------------------------------

# Frameworks whose frames are library code even when run from a source checkout.
_FRAMEWORK_DIRS = re.compile(
    r"/(?:torch|torchvision|torchaudio|transformers|accelerate|deepspeed|lightning|pytorch_lightning|numpy"
    r"|ray|megatron|vllm|peft|trl|datasets|huggingface_hub|safetensors|botocore|boto3|s3fs|fsspec|gcsfs"
    r"|urllib3|requests|httpx|aiohttp|grpc|google|azure|mlflow|airflow|kubernetes|jax|flax|tensorflow|keras)/"
)


_PACKAGES = re.compile(r"(?:^|/)(?:site|dist)-packages/|/lib(?:64)?/python|(?:^|/)runpy\.py$")


def is_library_path(path: str) -> bool:
    """Whether a traceback frame's file is library code (site-packages, stdlib, a framework)."""
    norm = path.replace("\\", "/")
    if norm.startswith("<"):
        return True
    if _PACKAGES.search(norm) or _FRAMEWORK_DIRS.search(norm):
        return True
    if "/" not in norm and norm.endswith(".py") and norm[:-3] in sys.stdlib_module_names:
        return True  # a frozen or relocated interpreter prints stdlib frames as bare "socket.py"
    return norm.rsplit("/", 2)[-2:-1] == ["bin"]
