//! The server loop's bounds against hostile clients, on real sockets: slowloris connections and
//! idle keep-alive connections are closed at the header deadline, the connection cap holds, and
//! a client that stops reading its answer is cut off.

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::{Request, Response};
use kvgate_http::{serve_with, stream_channel, RespBody, ServeLimits};
use std::convert::Infallible;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Serves `GET /` with "ok" and `GET /flood` with an endless stream, on its own runtime thread.
fn start(limits: ServeLimits) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            let make = || {
                hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async move {
                    if req.uri().path() == "/flood" {
                        let (tx, body) = stream_channel(4);
                        tokio::spawn(async move {
                            let chunk = Bytes::from(vec![b'x'; 64 << 10]);
                            while tx.send(chunk.clone()).await.is_ok() {}
                        });
                        return Ok::<Response<RespBody>, Infallible>(Response::new(body));
                    }
                    Ok(Response::new(
                        http_body_util::Full::new(Bytes::from_static(b"ok")).boxed(),
                    ))
                })
            };
            serve_with(listener, limits, make, std::future::pending()).await
        })
    });
    rx.recv().unwrap()
}

/// Whether the server closed `s` within `within` (a read returns end of stream or an error).
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return false,
            Err(_) => return true,
        }
    }
}

#[test]
fn slow_headers_and_idle_keep_alive_are_closed() {
    let addr = start(ServeLimits {
        header_timeout: Duration::from_millis(500),
        ..ServeLimits::default()
    });
    // Slowloris: a request head that never ends.
    let mut slow: Vec<TcpStream> = (0..50)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nx-slow: 1\r\n")
                .unwrap();
            s
        })
        .collect();
    // Silent: a connection that never sends a byte.
    let mut silent = TcpStream::connect(addr).unwrap();
    // Idle keep-alive: one request answered, then nothing.
    let mut idle = TcpStream::connect(addr).unwrap();
    idle.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let mut buf = [0u8; 256];
    let n = idle.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let t = Instant::now();
    for s in slow.iter_mut().chain([&mut silent, &mut idle]) {
        assert!(closed_within(s, Duration::from_secs(5)), "still open");
    }
    assert!(t.elapsed() < Duration::from_secs(5));
    // The server still serves.
    let mut ok = TcpStream::connect(addr).unwrap();
    ok.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    ok.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[test]
fn the_connection_cap_holds_and_frees() {
    let addr = start(ServeLimits {
        max_connections: 2,
        header_timeout: Duration::from_millis(800),
        ..ServeLimits::default()
    });
    let _a = TcpStream::connect(addr).unwrap();
    let _b = TcpStream::connect(addr).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    // The third waits in the backlog: no answer while the two slots are held...
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .unwrap();
    c.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut buf = [0u8; 64];
    assert!(c.read(&mut buf).is_err(), "served past the cap");
    // ...and is served once the silent two are closed at their header deadline.
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut answer = String::new();
    c.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[test]
fn a_client_that_stops_reading_is_cut_off() {
    let addr = start(ServeLimits {
        write_stall: Duration::from_millis(500),
        ..ServeLimits::default()
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /flood HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    // Never read: the socket buffers fill, the server's writes block, and the stall deadline
    // closes the connection.
    std::thread::sleep(Duration::from_secs(2));
    let t = Instant::now();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0usize;
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => total += n,
        }
        assert!(t.elapsed() < Duration::from_secs(10), "never cut off");
    }
    // Only what sat in the buffers arrived, not an endless stream.
    assert!(total < 64 << 20, "{total} bytes");
}
