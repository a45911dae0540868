//! The gateway's two listeners: the tenants' API behind the tower stack ([`crate::service`]),
//! and the admin API with `/metrics` ([`crate::admin`]).

use crate::state::Gateway;
use crate::{admin, service};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The tenants' API served on several threads (see [`Gateway::run_threads`]).
#[derive(Debug)]
pub struct ApiThreads {
    /// The address the listeners share (the port assigned when `listen` asked for port 0).
    pub addr: SocketAddr,
    threads: Vec<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl ApiThreads {
    /// Waits for every thread to finish serving (after the shutdown signal): all of them, even
    /// after one has failed, so none is cut off mid-answer. The first failure is returned.
    pub fn join(self) -> std::io::Result<()> {
        let mut first = Ok(());
        for t in self.threads {
            let served = t
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("an API thread panicked")));
            if first.is_ok() {
                first = served;
            }
        }
        first
    }
}

/// A listening socket on `addr` that other sockets of this process may share (SO_REUSEPORT):
/// the kernel spreads incoming connections over them.
fn shared_listener(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

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

    /// Serves the tenants' API on `threads` threads until `shutdown` turns true. Each thread runs
    /// its own single-threaded event loop with its own listener on `addr` (SO_REUSEPORT) and
    /// its own connections to engines, so a request is read, routed, proxied and answered on
    /// one thread, as in nginx's worker processes: no task wakes another thread. The shared
    /// state (keys, limits, the prefix index) is the same `Gateway`. `max_connections` is
    /// divided among the threads.
    pub fn run_threads(
        self: Arc<Self>,
        addr: SocketAddr,
        threads: usize,
        shutdown: watch::Receiver<bool>,
    ) -> std::io::Result<ApiThreads> {
        // A connection cap below the thread count would otherwise be raised to it.
        let threads = threads.clamp(1, self.config.max_connections.max(1));
        if addr.port() != 0 {
            // Listeners that share a port share it with any socket of this user that asks to, a
            // gateway still running from before among them: take the port alone first, so that
            // one already in use is an error, as it is for a single listener.
            drop(std::net::TcpListener::bind(addr)?);
        }
        let first = shared_listener(addr)?;
        let addr = first.local_addr()?;
        let mut listeners = vec![first];
        for _ in 1..threads {
            listeners.push(shared_listener(addr)?);
        }
        let mut limits = self.config.serve_limits();
        limits.max_connections = limits.max_connections.div_ceil(threads).max(1);
        let mut handles = Vec::new();
        for (i, listener) in listeners.into_iter().enumerate() {
            let gw = self.clone();
            let mut stop = shutdown.clone();
            let handle = std::thread::Builder::new()
                .name(format!("kvgate-api-{i}"))
                .spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?;
                    let served = runtime.block_on(async move {
                        let listener = TcpListener::from_std(listener)?;
                        let stopped = async move {
                            let _ = stop.wait_for(|s| *s).await;
                        };
                        kvgate_http::serve_with(
                            listener,
                            limits,
                            move || service::stack(gw.clone()),
                            stopped,
                        )
                        .await
                    });
                    if let Err(e) = &served {
                        tracing::error!(thread = i, error = %e, "an API thread stopped serving");
                    }
                    served
                })?;
            handles.push(handle);
        }
        Ok(ApiThreads {
            addr,
            threads: handles,
        })
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
