"""Typed service errors. Service cores raise them; the gRPC server turns them into status codes and the
gRPC clients turn status codes back into them, so callers handle one set of exceptions either way."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc


class ServiceError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str = "", *, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Internal(ServiceError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE = {
    cls.code: cls
    for cls in (
        NotFound,
        InvalidArgument,
        FailedPrecondition,
        DeadlineExceeded,
        Unavailable,
        ResourceExhausted,
        Unauthenticated,
        Internal,
    )
}


def error_for(code: grpc.StatusCode, message: str) -> ServiceError:
    """The typed error for a status code; codes without a subclass give a plain ServiceError."""
    cls = _BY_CODE.get(code)
    return cls(message) if cls else ServiceError(message, code=code)


def from_rpc_error(err: grpc.RpcError) -> ServiceError:
    """The typed error for a failed call."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    message = (err.details() if hasattr(err, "details") else "") or str(code)
    error = error_for(code, message)
    error.__cause__ = err
    return error


@contextlib.contextmanager
def rpc_errors() -> Iterator[None]:
    """Wrap a client call: `with rpc_errors(): await stub.X(...)` raises the typed error instead."""
    try:
        yield
    except grpc.RpcError as err:
        raise from_rpc_error(err) from err
