//! The HTTP/1.1 accept loop shared by the engine and the gateway, with the bounds a server facing
//! untrusted clients needs:
//! - a connection cap: past it the loop stops accepting (the kernel's backlog holds the rest), so
//!   a flood of connections cannot take every descriptor;
//! - a header deadline: a connection must deliver a complete request head within
//!   `header_timeout` of opening or of finishing its previous response (hyper's header read
//!   timer, which on a kept-alive connection also runs while it is idle), so slowloris clients
//!   and idle keep-alive connections are closed;
//! - a write-stall deadline: a client that stops reading (its socket buffer full) for
//!   `write_stall` has its connection closed, which drops the response body and, on a stream,
//!   cancels the request upstream, so a reader that never reads cannot pin buffers or KV blocks;
//! - accept errors (EMFILE, ENFILE, ENOBUFS) back off exponentially instead of spinning, and are
//!   logged at most once a second with the count of those not logged.

use crate::RespBody;
use hyper::body::Incoming;
use hyper::{Request, Response};
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Semaphore;

/// Bounds on the connections one server holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// Most connections open at once.
    pub max_connections: usize,
    /// Time allowed for a request head, from the connection's start or its last response (also
    /// the idle keep-alive limit).
    pub header_timeout: Duration,
    /// Longest a write may wait on a client that does not read.
    pub write_stall: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            max_connections: 4096,
            header_timeout: Duration::from_secs(30),
            write_stall: Duration::from_secs(30),
        }
    }
}

/// A connection's service: what `make` returns for each accepted connection.
pub trait ConnService:
    hyper::service::Service<
        Request<Incoming>,
        Response = Response<RespBody>,
        Error = Infallible,
        Future: Send + 'static,
    > + Send
    + 'static
{
}

impl<S> ConnService for S where
    S: hyper::service::Service<
            Request<Incoming>,
            Response = Response<RespBody>,
            Error = Infallible,
            Future: Send + 'static,
        > + Send
        + 'static
{
}

/// Longest pause after repeated accept failures.
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// [`serve_with`] under the default [`ServeLimits`].
pub async fn serve<S: ConnService>(
    listener: tokio::net::TcpListener,
    make: impl Fn() -> S,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    serve_with(listener, ServeLimits::default(), make, shutdown).await
}

/// Serves HTTP/1.1 connections from `listener` with a fresh service per connection (from
/// `make`), TCP_NODELAY on every socket, within `limits`, until `shutdown` completes;
/// connections in flight then finish (streams included) before this returns.
pub async fn serve_with<S: ConnService>(
    listener: tokio::net::TcpListener,
    limits: ServeLimits,
    make: impl Fn() -> S,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let mut shutdown = std::pin::pin!(shutdown);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let mut backoff = AcceptBackoff::default();
    loop {
        let accepted = tokio::select! {
            accepted = async {
                // A slot first: at the cap, nothing more is taken off the backlog.
                let slot = slots.clone().acquire_owned().await;
                (slot, listener.accept().await)
            } => accepted,
            () = &mut shutdown => break,
        };
        let (Ok(slot), accepted) = accepted else {
            break;
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                backoff.reset();
                stream
            }
            Err(e) => {
                let pause = backoff.failed(&e);
                tokio::select! {
                    () = tokio::time::sleep(pause) => continue,
                    () = &mut shutdown => break,
                }
            }
        };
        let _ = stream.set_nodelay(true);
        let io = StallGuard::new(stream, limits.write_stall);
        let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(io), make());
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended");
            }
            drop(slot);
        });
    }
    // Refuse new connections at once (rather than leave them in the backlog until the process
    // exits) while the ones in flight finish.
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// A socket whose writes fail with `TimedOut` once they have been blocked for `limit` (the
/// peer stopped reading); reads pass through.
#[derive(Debug)]
struct StallGuard<T> {
    io: T,
    limit: Duration,
    /// Running while writes are blocked.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> StallGuard<T> {
    fn new(io: T, limit: Duration) -> Self {
        StallGuard {
            io,
            limit,
            stalled: None,
        }
    }

    /// After a write came back pending: starts the stall clock, or fails once it has run out.
    fn pending<R>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<R>> {
        let limit = self.limit;
        let sleep = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if sleep.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client stopped reading",
            )));
        }
        Poll::Pending
    }

    fn progressed<R>(
        &mut self,
        r: Poll<io::Result<R>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<R>> {
        match r {
            Poll::Pending => self.pending(cx),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallGuard<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallGuard<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.progressed(r, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.progressed(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.progressed(r, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_shutdown(cx);
        self.progressed(r, cx)
    }
}

/// Pauses after failed accepts (doubling from 5 ms to [`MAX_ACCEPT_BACKOFF`]) and rate-limits
/// their log lines to one a second.
#[derive(Debug, Default)]
struct AcceptBackoff {
    pause: Duration,
    logged_at: Option<Instant>,
    suppressed: u64,
}

impl AcceptBackoff {
    fn reset(&mut self) {
        self.pause = Duration::ZERO;
    }

    /// Records a failure; returns how long to wait before the next accept.
    fn failed(&mut self, e: &std::io::Error) -> Duration {
        self.pause = (self.pause * 2).clamp(Duration::from_millis(5), MAX_ACCEPT_BACKOFF);
        let now = Instant::now();
        if self
            .logged_at
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
        {
            tracing::warn!(
                error = %e,
                not_logged = self.suppressed,
                pause_ms = self.pause.as_millis() as u64,
                "accept failed; backing off"
            );
            self.logged_at = Some(now);
            self.suppressed = 0;
        } else {
            self.suppressed += 1;
        }
        self.pause
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_backoff_doubles_to_its_cap_and_resets() {
        let mut b = AcceptBackoff::default();
        let e = std::io::Error::from_raw_os_error(24); // EMFILE
        let pauses: Vec<u128> = (0..10).map(|_| b.failed(&e).as_millis()).collect();
        assert_eq!(pauses[..4], [5, 10, 20, 40]);
        assert_eq!(*pauses.last().unwrap(), 1000);
        // One line logged; the other nine counted.
        assert_eq!(b.suppressed, 9);
        b.reset();
        assert_eq!(b.failed(&e).as_millis(), 5);
    }
}
