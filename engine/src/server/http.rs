//! HTTP plumbing shared with the gateway lives in `kvgate-http`.

pub use kvgate_http::*;
