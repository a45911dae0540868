//! The gateway's two listeners: the tenants' API behind the tower stack ([`crate::service`]),
//! and the admin API with `/metrics` ([`crate::admin`]).

use crate::state::Gateway;
use crate::{admin, service};
use std::future::Future;
use std::sync::Arc;
use tokio::net::TcpListener;

impl Gateway {
    /// Serves the tenants' API until `shutdown`; streams in flight finish first.
    pub async fn run(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> std::io::Result<()> {
        let limits = self.config.serve_limits();
        kvgate_http::serve_with(
            listener,
            limits,
            move || service::stack(self.clone()),
            shutdown,
        )
        .await
    }

    /// Serves the admin API and `/metrics` until `shutdown`.
    pub async fn run_admin(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> std::io::Result<()> {
        let limits = self.config.serve_limits();
        kvgate_http::serve_with(
            listener,
            limits,
            move || {
                let gw = self.clone();
                hyper::service::service_fn(move |req| {
                    let gw = gw.clone();
                    async move { Ok(admin::route(gw, req).await) }
                })
            },
            shutdown,
        )
        .await
    }
}
