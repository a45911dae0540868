//! HTTP plumbing shared with the gateway lives in `kvgate-http`; the engine adds one thing to its
//! error responses: `x-kvgate-fault: engine` on every 5xx that is the engine's own failure. The
//! gateway counts only those (and broken connections) against the engine's circuit breaker, so
//! no request's own mistake, nor a drain, can open it. The names below shadow the shared ones,
//! so every engine handler gets the header without thinking of it.

pub use kvgate_http::*;

use hyper::header::HeaderValue;
use hyper::Response;
use kvgate_protocol::openai::{ApiError, ErrorCode};

/// Whether `e` is the engine's failure rather than the request's or an operator's choice: every
/// 5xx but draining.
pub fn is_engine_fault(e: &ApiError) -> bool {
    e.status >= 500 && e.code != ErrorCode::Draining
}

/// The one place an engine [`ApiError`] becomes an HTTP response.
pub fn error_response(e: &ApiError) -> Response<RespBody> {
    let mut r = kvgate_http::error_response(e);
    if is_engine_fault(e) {
        r.headers_mut()
            .insert(FAULT_HEADER, HeaderValue::from_static("engine"));
    }
    r
}

/// 200 with `value` as JSON (a serialization failure is the engine's 500).
pub fn ok_json<T: serde::Serialize>(value: &T) -> Response<RespBody> {
    match serde_json::to_string(value) {
        Ok(s) => json_response(hyper::StatusCode::OK, s),
        Err(e) => error_response(&ApiError::internal(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_engine_failures_carry_the_fault_header() {
        let fault = |e: ApiError| {
            error_response(&e)
                .headers()
                .get(FAULT_HEADER)
                .map(|v| v.to_str().unwrap_or_default().to_owned())
        };
        assert_eq!(fault(ApiError::internal("boom")).as_deref(), Some("engine"));
        assert_eq!(
            fault(ApiError::unavailable("The engine is not running.")).as_deref(),
            Some("engine")
        );
        assert_eq!(fault(ApiError::draining()), None);
        assert_eq!(fault(ApiError::invalid_value("n", "bad")), None);
        assert_eq!(fault(ApiError::unauthorized("no")), None);
    }
}
