"""The aggregator's gRPC server, bounded: uploads stopped at their declared size (sender and size
named), a stopped federation's reason served to every caller, enrolled certificates enforced."""

from __future__ import annotations

import logging
from typing import Any

import grpc
from openfl.transport.grpc import aggregator_server as grpc_server
from openfl.transport.grpc import common as grpc_common

from .protocol import FederationStopped

# one logger for the plan's components, as log lines name it
logger = logging.getLogger("fedcontrast.openfl.components")


# --- uploads bounded while they stream in -------------------------------------------------------
# OpenFL reads a whole upload (2 MiB chunks) into memory and the tensor database before anything
# checks its size; the aggregator's gRPC server here stops reading at the declared size instead,
# naming the sender and the size, and gRPC takes no single message much larger than that (see
# MESSAGE_ALLOWANCE: a message over gRPC's own limit is refused before Python sees it, unnamed).
MAX_MESSAGE_BYTES: int | None = None  # set by SafeAggregator, read when the server is created


def certificate_name(context: Any) -> str | None:
    """The common name of the caller's client certificate (mutual TLS), else None."""
    try:
        names = context.auth_context().get("x509_common_name") or []
    except Exception:  # no context, or one without authentication
        names = []
    return names[0].decode() if names else None


def peer_name(context: Any) -> str:
    """The sender as its client certificate names it (mutual TLS), else its network address."""
    name = certificate_name(context)
    return f"collaborator {name}" if name is not None else f"the client at {context.peer()}"


def _bounded_stream(stream, limit: int, context: Any, aggregator: Any):
    received = 0
    try:
        for chunk in stream:
            received += len(chunk.npbytes)
            if received > limit:
                reason = aggregator.refuse_upload(peer_name(context), received, context)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
            yield chunk
    except grpc.RpcError:  # the call ended under the stream: the sender went away, or gRPC refused a message
        logger.warning("%s's upload broke off after %d bytes: its connection ended, or it sent a single message over "
                       "gRPC's limit of %s bytes (OpenFL's client never does)", peer_name(context), received,
                       MAX_MESSAGE_BYTES if MAX_MESSAGE_BYTES is not None else grpc_common.MAX_MESSAGE_LENGTH_BYTES)
        raise


_stock_send_local_task_results = grpc_server.AggregatorGRPCServer.SendLocalTaskResults
_stock_get_tasks = grpc_server.AggregatorGRPCServer.GetTasks
_stock_create_grpc_server = grpc_server.create_grpc_server


def _bounded_send_local_task_results(self, request, context):
    limit = getattr(self.aggregator, "max_upload_bytes", None)
    if limit is not None:
        request = _bounded_stream(request, limit, context, self.aggregator)
    try:
        return _stock_send_local_task_results(self, request, context)
    except FederationStopped as stop:  # an upload after the federation stopped: the sender learns why
        context.abort(grpc.StatusCode.ABORTED, str(stop))


def _get_tasks_or_stop_notice(self, request, context):
    """OpenFL's GetTasks (the caller validated first); once the aggregator has stopped the federation,
    its quit answer becomes an ABORTED status whose details say why (:meth:`SafeAggregator.stop_notice`)."""
    response = _stock_get_tasks(self, request, context)
    notice = getattr(self.aggregator, "stop_notice", None)
    reason = notice(request.header.sender) if response.quit and notice is not None else None
    if reason is not None:
        context.abort(grpc.StatusCode.ABORTED, reason)
    return response


def _bounded_grpc_server(*args: Any, **kwargs: Any):
    """OpenFL's server, with its largest accepted message bounded by :data:`MAX_MESSAGE_BYTES`, and
    without SO_REUSEPORT: a port another process holds fails to bind instead of being shared."""
    stock = grpc_common.DEFAULT_CHANNEL_OPTIONS
    options = {"grpc.so_reuseport": 0}
    if MAX_MESSAGE_BYTES is not None:
        options["grpc.max_receive_message_length"] = MAX_MESSAGE_BYTES
    grpc_common.DEFAULT_CHANNEL_OPTIONS = [o for o in stock if o[0] not in options] + list(options.items())
    try:
        return _stock_create_grpc_server(*args, **kwargs)
    finally:
        grpc_common.DEFAULT_CHANNEL_OPTIONS = stock


_stock_get_aggregated_tensor = grpc_server.AggregatorGRPCServer.GetAggregatedTensor


def _aggregated_tensor_or_stop_notice(self, request, context):
    """OpenFL's GetAggregatedTensor; a fetch after the federation stopped (a site waiting in the secure
    aggregation protocol) is answered with an ABORTED status saying why."""
    try:
        return _stock_get_aggregated_tensor(self, request, context)
    except FederationStopped as stop:
        context.abort(grpc.StatusCode.ABORTED, str(stop))


grpc_server.AggregatorGRPCServer.SendLocalTaskResults = _bounded_send_local_task_results
grpc_server.AggregatorGRPCServer.GetAggregatedTensor = _aggregated_tensor_or_stop_notice
grpc_server.AggregatorGRPCServer.GetTasks = _get_tasks_or_stop_notice
grpc_server.create_grpc_server = _bounded_grpc_server

# --- one certificate per name -------------------------------------------------------------------
# OpenFL admits any certificate of the federation's CA whose common name is the name the caller claims;
# here it must also be the very certificate signed for that name, and not revoked.
_stock_validate_collaborator = grpc_server.AggregatorGRPCServer.validate_collaborator


def _validate_enrolled_collaborator(self, request, context):
    """OpenFL's check (the certificate's common name is the sender's name, one of cols.yaml), then
    :meth:`SafeAggregator.refuse_certificate`: a refusal ends the call with UNAUTHENTICATED and its sentence."""
    _stock_validate_collaborator(self, request, context)
    refuse = getattr(self.aggregator, "refuse_certificate", None)
    if refuse is None or not (self.use_tls and self.require_client_auth):
        return
    reason = refuse(request.header.sender, context)
    if reason is not None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)


grpc_server.AggregatorGRPCServer.validate_collaborator = _validate_enrolled_collaborator
