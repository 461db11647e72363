"""`slc loadtest`: a load generator for a running slc server, beside the server (it uses only
the HTTP API, and the v2 gRPC service for the grpc endpoint). client (targets, requests,
transports) -> run (one load run) -> stats (samples, percentiles) -> report (json, markdown,
plot); cli holds the command."""
from tools.loadtest.client import ENDPOINT_NAMES, V2_ENDPOINTS, RemoteTargetError, check_target, normalize_url
from tools.loadtest.run import measure_ceiling, run_loadtest, run_with_ceiling, wrk_ceiling
from tools.loadtest.stats import LoadtestResult, Samples, latency_summary, nearest_rank_percentiles, summarize

__all__ = [
    "ENDPOINT_NAMES", "V2_ENDPOINTS", "LoadtestResult", "RemoteTargetError", "Samples", "check_target", "latency_summary",
    "measure_ceiling", "nearest_rank_percentiles", "normalize_url", "run_loadtest", "run_with_ceiling",
    "summarize", "wrk_ceiling",
]
