//! What the tower stack ([`crate::service`]) attaches to a request for the handlers
//! ([`crate::api`]): its id and its body limit. The authenticated principal travels as an
//! `Arc<`[`crate::auth::Principal`]`>`.

use std::sync::Arc;

/// The request's id (client-sent `x-request-id` when sane, else generated).
#[derive(Debug, Clone)]
pub struct RequestId(pub Arc<str>);

/// The body limit, for the handler's bounded read.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);
