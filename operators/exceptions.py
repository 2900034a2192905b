"""One small exception class per failure mode.

The retry policy (`operators.retry.ClassifiedRetryPolicy`) decides RETRY vs FAIL from these
types alone, so every operator raises one of them rather than a bare AirflowException.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow.sdk.exceptions import AirflowException

if TYPE_CHECKING:
    from operators.failures import Verdict


class GangflowError(AirflowException):
    """Base class of every gangflow failure."""

    retryable: bool = False
    kind: str = "user"


class InfraError(GangflowError):
    """Something outside the user's code broke (node, network, storage, a remote service)."""

    retryable = True
    kind = "infra"


class UserError(GangflowError):
    """The user's code, config or data is wrong; retrying would repeat it. The Airflow side's,
    raised in a task itself; a rank's `trainer.errors.UserError` reaches the task as exit code 1
    and its error record, which the classifier turns into a `UserFailure`."""

    retryable = False
    kind = "user"


class GangControlError(GangflowError):
    """A pause or resume cannot be done (no such running gang, already paused, not paused); the message says which."""


class GangFailure(GangflowError):
    """A training gang failed; carries the classifier's verdict and the evidence behind it."""

    def __init__(self, verdict: Verdict, *, evidence: dict | None = None, attempt: int | None = None):
        self.verdict = verdict
        self.evidence = evidence or {}
        self.attempt = attempt
        super().__init__(verdict.reason)  # the reason names the kind and the decisive signal

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.verdict.kind

    @property
    def retryable(self) -> bool:  # type: ignore[override]
        return self.verdict.retryable


class InfraFailure(GangFailure):
    """The gang failed for an infrastructure reason: retry, resume from the last checkpoint."""


class UserFailure(GangFailure):
    """The gang failed because of the user's code, config or data: fail at once."""


class UnknownFailure(GangFailure):
    """The evidence matched no rule: retried once, then treated as a user failure."""


class GangCapacityError(UserError):
    """The gang can never be admitted (more ranks than the pool or cluster can hold)."""


class InvalidParams(UserError):
    """A DAG run's Params break a rule the trigger form's JSON Schema cannot express (NaN, 2.0 for
    an integer, a cross-field rule); the message names every offending field."""


class UnsupportedCombination(InvalidParams):
    """The chosen backend cannot run the chosen launcher (e.g. ray with mpirun); names both."""


class GangAdmissionTimeout(InfraError):
    """The gang was not admitted (or not all ranks became Ready) within the timeout."""


class DatasetHashMismatch(UserError):
    """The dataset's bytes differ from the hash pinned for its version."""


class DatasetVersionNotFound(UserError):
    """The requested dataset version is not in dvc.lock, the DVC cache or the remote."""


class DataValidationFailed(UserError):
    """Great Expectations expectations failed; the message lists which."""


class StorageUnavailable(InfraError):
    """The DVC remote, checkpoint storage or artifact store could not be reached."""


class RegistryUnavailable(InfraError):
    """The MLflow tracking server or model registry could not be reached."""


class KubernetesApiError(InfraError):
    """A Kubernetes API call failed for a reason worth retrying (5xx, timeouts, conflicts)."""


class KubernetesRequestError(UserError):
    """The Kubernetes API refused a request (4xx: forbidden by RBAC, invalid object, missing CRD).

    Retrying would be refused the same way; the message carries the API's own reason.
    """


class GangConfigError(UserError):
    """The gang's runtime configuration (runtime ConfigMap, per-task overrides) is invalid."""
