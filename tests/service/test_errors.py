"""The error table (service/errors.py): every error type has a status and a reason, lookups walk the
classes, and the statuses are real gRPC codes (the httpx test_exceptions pattern)."""

from __future__ import annotations

import grpc
import pytest

from service import errors
from service.errors import REASON_OF, STATUS_OF, ServiceError, reason_of, status_of


def every_subclass(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *every_subclass(sub)]
    return found


ERRORS = every_subclass(ServiceError)


def instance(cls: type[ServiceError]) -> ServiceError:
    if issubclass(cls, errors.InvalidInput):
        return cls("field", "bad")
    if issubclass(cls, errors.NonFiniteOutput):
        return cls()
    if issubclass(cls, errors.ModelFailure):
        return cls("failed")
    return cls("message")


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_error_type_maps_to_a_grpc_status_and_a_reason(cls):
    error = instance(cls)
    assert grpc.StatusCode[status_of(error)] not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN)
    assert reason_of(error) == REASON_OF[cls]  # every type counts under its own reason label


def test_the_table_knows_only_error_types_and_subclasses_inherit_their_parents_status():
    assert set(STATUS_OF) <= set(ERRORS) and set(REASON_OF) == set(ERRORS)
    assert status_of(errors.DeadlineUnmeetable("x")) == "DEADLINE_EXCEEDED"
    assert status_of(errors.NonFiniteOutput()) == "INTERNAL"

    class Unlisted(errors.Overloaded):
        pass

    assert (status_of(Unlisted("x")), reason_of(Unlisted("x"))) == ("RESOURCE_EXHAUSTED", "queue_full")
